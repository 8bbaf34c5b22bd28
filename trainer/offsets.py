"""How far a training job got in ``hidden_states.ready``: which offsets of each
partition the trainer has consumed, and the Kafka commit that follows.

A sample's :class:`Position` covers the offsets from the one after the previous
sample its worker took from that partition up to its own ready event, so the
offsets of records that yielded no sample (transaction markers, a re-announced
duplicate, a row without supervised tokens) are consumed with the next sample.
A shuffle buffer hands samples out of order: the Kafka commit of a partition is
the first offset not consumed yet (``next_offset``), and the offsets consumed
above it are kept in :meth:`Progress.state` for a checkpoint, so that a job
resumed from its checkpoint skips them.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from confluent_kafka import TopicPartition

from hsx.schemas.training import OnlineLoaderState, PartitionPosition


@dataclass(frozen=True)
class Position:
    """Where a sample lies in Kafka: offsets ``first..last`` of ``partition``,
    read by a worker that started the partition at ``origin``."""

    partition: int
    origin: int
    first: int
    last: int


@dataclass
class _Partition:
    next_offset: int
    consumed: set[int] = field(default_factory=set)
    committed: int | None = None


class Progress:
    """The consumed offsets of every partition seen, in the trainer's process."""

    def __init__(self) -> None:
        self._partitions: dict[int, _Partition] = {}

    def start(self, partition: int) -> tuple[int, set[int]] | None:
        """Where a worker resumes ``partition`` (next offset, offsets to skip), if known."""
        known = self._partitions.get(partition)
        return None if known is None else (known.next_offset, set(known.consumed))

    def consume(self, positions: Iterable[Position]) -> None:
        """Mark the offsets behind these samples consumed."""
        for pos in positions:
            part = self._partitions.setdefault(pos.partition, _Partition(pos.origin))
            if pos.origin > part.next_offset:  # the worker began at a later commit: all below it is consumed
                part.next_offset = pos.origin
                part.consumed = {o for o in part.consumed if o >= pos.origin}
            part.consumed.update(range(max(pos.first, part.next_offset), pos.last + 1))
            while part.next_offset in part.consumed:
                part.consumed.discard(part.next_offset)
                part.next_offset += 1

    def to_commit(self, topic: str) -> list[TopicPartition]:
        """Partitions whose next offset moved since the last :meth:`committed`."""
        return [TopicPartition(topic, p, part.next_offset) for p, part in sorted(self._partitions.items())
                if part.committed != part.next_offset]

    def committed(self, offsets: Iterable[TopicPartition]) -> None:
        """Kafka has these commits (from :meth:`to_commit`)."""
        for tp in offsets:
            self._partitions[tp.partition].committed = tp.offset

    def state(self, topic: str, group_id: str) -> OnlineLoaderState:
        """The checkpointable position (``ReadyStream.state_dict``)."""
        return OnlineLoaderState(topic=topic, group_id=group_id, partitions=[
            PartitionPosition(partition=p, next_offset=part.next_offset, consumed=sorted(part.consumed))
            for p, part in sorted(self._partitions.items())])

    @classmethod
    def from_state(cls, state: OnlineLoaderState) -> Progress:
        """Resume where :meth:`state` was taken."""
        progress = cls()
        for pos in state.partitions:
            progress._partitions[pos.partition] = _Partition(pos.next_offset, set(pos.consumed))
        return progress
