"""One assigned partition of ``hidden_states.blocks``: its reassembly, its open
shard, what the dataset already holds (dedupe), and the storage backoff."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from schemas import HiddenStatesReady
from sink.assembler import Assembler
from sink.shards import OpenShard, partition_prefix, read_indexes, remove_orphans, stored_token_ids
from sink.storage import Storage

log = logging.getLogger(__name__)

_FIRST_BACKOFF, _MAX_BACKOFF = 0.5, 30.0


@dataclass
class PartitionState:
    topic: str
    partition: int
    assembler: Assembler
    shard: OpenShard
    seen: dict[str, HiddenStatesReady]
    """Samples already in the dataset (from its index): later copies are duplicates."""
    republish: list[tuple[HiddenStatesReady, list[int]]] = field(default_factory=list)
    """Ready events of duplicates, published again (consumers de-duplicate by event
    id): a crash between writing a shard and publishing its events must not leave
    trainers without them."""
    retry_at: float = 0.0
    backoff: float = _FIRST_BACKOFF

    @classmethod
    def load(cls, storage: Storage, topic: str, partition: int, incomplete_timeout: float) -> PartitionState:
        """The partition as the dataset left it: shards a crash left without an
        index are removed (their records are replayed), indexed samples are seen."""
        prefix = partition_prefix(topic, partition)
        for orphan in remove_orphans(storage, prefix):
            log.warning("removed %s: written before a crash, never indexed (its records will be replayed)", orphan)
        seen = {e.request_id: e for index in read_indexes(storage, prefix) for e in index.events}
        return cls(topic, partition, Assembler(incomplete_timeout), OpenShard(topic, partition), seen)

    @property
    def key(self) -> tuple[str, int]:
        return (self.topic, self.partition)

    @property
    def buffered_bytes(self) -> int:
        return self.assembler.pending_bytes + self.shard.nbytes

    def stored_token_ids(self, storage: Storage, request_id: str) -> list[int] | None:
        """The token ids of the copy of ``request_id`` the dataset already holds (in
        a shard, or in the open one), or None for a new request."""
        if request_id in self.seen:
            return stored_token_ids(storage, self.seen[request_id])
        return next((s.manifest.token_ids for s in self.shard.samples if s.manifest.request_id == request_id), None)

    # -- writing the open shard, with backoff after storage errors ---------------------------

    def may_write(self, now: float | None = None) -> bool:
        """False while a storage error's backoff runs."""
        return (time.monotonic() if now is None else now) >= self.retry_at

    def write_failed(self) -> float:
        """Start (or double) the backoff; returns the seconds to wait."""
        waited = self.backoff
        self.retry_at = time.monotonic() + waited
        self.backoff = min(self.backoff * 2, _MAX_BACKOFF)
        return waited

    def written(self, events: list[HiddenStatesReady]) -> None:
        """The open shard is durable and indexed: its samples are seen, a new shard opens."""
        self.backoff = _FIRST_BACKOFF
        self.seen.update((e.request_id, e) for e in events)
        self.shard = OpenShard(self.topic, self.partition)
