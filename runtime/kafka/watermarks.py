"""Per-partition commit watermarks, shared by the extractor and the sink.

Records finish out of order (short prompts overtake long ones, a sample waits
for its shard while later records are dropped as duplicates), but a Kafka offset
commit says "everything before this is done". A partition's commit position is
therefore the lowest offset that is not done yet.
"""

from __future__ import annotations

from dataclasses import dataclass, field

TopicPartitionKey = tuple[str, int]


@dataclass
class _Partition:
    pending: set[int] = field(default_factory=set)
    highest_tracked: int = -1
    """Highest offset tracked so far; the position is this + 1 when nothing is pending."""
    committed: int | None = None


class Watermarks:
    """Tracks, per partition, which consumed offsets are still in flight.

    ``track`` when a record is consumed, ``done`` when everything it caused is
    durable (records acknowledged by Kafka, or dead-lettered). ``positions`` gives
    the offsets that may be committed: never past an unfinished record.
    """

    def __init__(self) -> None:
        self._partitions: dict[TopicPartitionKey, _Partition] = {}

    def track(self, tp: TopicPartitionKey, offset: int) -> None:
        part = self._partitions.setdefault(tp, _Partition())
        part.pending.add(offset)
        part.highest_tracked = max(part.highest_tracked, offset)

    def done(self, tp: TopicPartitionKey, offset: int) -> None:
        """Mark one offset finished. Unknown partitions (revoked meanwhile) are ignored."""
        part = self._partitions.get(tp)
        if part is not None:
            part.pending.discard(offset)

    def position(self, tp: TopicPartitionKey) -> int | None:
        """The next offset to commit for ``tp`` (Kafka's convention: the first
        offset not yet processed), or ``None`` if nothing was consumed."""
        part = self._partitions.get(tp)
        if part is None:
            return None
        return min(part.pending) if part.pending else part.highest_tracked + 1

    def to_commit(self) -> dict[TopicPartitionKey, int]:
        """Positions that moved since they were last marked committed."""
        out = {}
        for tp, part in self._partitions.items():
            position = self.position(tp)
            if position is not None and position != part.committed:
                out[tp] = position
        return out

    def committed(self, positions: dict[TopicPartitionKey, int]) -> None:
        """Record that ``positions`` were committed successfully."""
        for tp, position in positions.items():
            if tp in self._partitions:
                self._partitions[tp].committed = position

    def in_flight(self, tp: TopicPartitionKey | None = None) -> int:
        """Records consumed but not done: for one partition, or in total."""
        if tp is not None:
            part = self._partitions.get(tp)
            return len(part.pending) if part else 0
        return sum(len(p.pending) for p in self._partitions.values())

    def forget(self, tp: TopicPartitionKey) -> None:
        """Drop a revoked partition; its late completions are ignored."""
        self._partitions.pop(tp, None)
