"""The sink's memory budget (``--max-buffer-bytes``): what its partitions hold
in memory, and when that pauses consumption."""

from __future__ import annotations

import logging
from collections.abc import Mapping

from hsx.runtime.kafka.member import GroupMember
from hsx.runtime.kafka.watermarks import TopicPartitionKey
from hsx.sink.partition import PartitionState

log = logging.getLogger("hsx.sink.service")  # the service's logger: its lines read as the sink's


class MemoryBudget:
    """Bytes the partitions hold (pending blocks, open shards, shards not yet
    written) against the budget, and the member's partitions paused while over it."""

    def __init__(self, limit: int, partitions: Mapping[TopicPartitionKey, PartitionState],
                 member: GroupMember) -> None:
        self.limit = limit
        self._partitions = partitions
        self._member = member

    def buffered(self) -> int:
        return sum(state.buffered_bytes for state in self._partitions.values())

    def over(self) -> bool:
        return self.buffered() > self.limit

    def settle(self, over: bool) -> None:
        """Pause while ``over`` and something can be written to free memory; resume otherwise.

        Pausing frees memory only by letting shards be written. When incomplete
        samples alone hold the excess (a sample larger than the budget, or a
        killed attempt's blocks waiting for its retry), a pause would wait on
        records it stops fetching: consume on, so that they complete."""
        pause = over and any(state.shard.samples or state.closed for state in self._partitions.values())
        if pause != self._member.paused:
            self._member.pause(pause)
            log.warning("memory budget %s: partitions %s", "exceeded" if over else "ok", "paused" if pause else
                        "resumed" + (" for incomplete samples to complete" if over else ""))
