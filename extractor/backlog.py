"""Prompts fetched and not yet started: the extractor's local buffer, and the
backpressure rule that pauses its partitions.

librdkafka throws a partition's pre-fetched records away when the partition is
paused, and fetches them again on resume. Pausing as soon as ``max_inflight``
prompts were running paused and resumed around every completion: each resume
cost a fetch round trip in which the engine was one prompt short, and a fetch
(up to ``fetch.max.bytes``) whose rest the next pause discarded. So the
extractor holds up to ``capacity`` fetched prompts itself, pauses only when
they fill it, and resumes once it is down to half: one fetch per half a backlog,
and a finished prompt's successor is always at hand.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

from confluent_kafka import Message

from hsx.runtime.kafka.watermarks import TopicPartitionKey


class Backlog:
    """A FIFO of fetched prompts. The extractor polls for its :attr:`room` (at
    least one record, so that polling serves librdkafka's callbacks when it is
    full and paused), so it holds at most ``capacity`` + 1 prompts: memory is
    bounded by that many of the largest prompt event the schema admits."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"a backlog holds at least one prompt, got capacity {capacity}")
        self.capacity = capacity
        self._records: deque[Message] = deque()

    def __len__(self) -> int:
        return len(self._records)

    @property
    def room(self) -> int:
        """How many more records it takes."""
        return self.capacity - len(self._records)

    def add(self, records: Iterable[Message]) -> None:
        self._records.extend(records)

    def take(self) -> Message | None:
        """The oldest record, or None when empty."""
        return self._records.popleft() if self._records else None

    def drop(self, partitions: Iterable[TopicPartitionKey]) -> None:
        """Forget the records of revoked or lost partitions: their next owner
        fetches them from the committed offset."""
        gone = set(partitions)
        self._records = deque(r for r in self._records if (r.topic(), r.partition()) not in gone)

    def should_pause(self, paused: bool) -> bool:
        """Pause when full; once paused, stay paused until it is down to half."""
        if paused:
            return len(self._records) > self.capacity // 2
        return len(self._records) >= self.capacity
