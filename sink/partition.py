"""One assigned partition of ``hidden_states.blocks``: its reassembly, its open
shard, its closed shards waiting to be written, its by-reference manifests
waiting for the payload store, what the dataset already holds (dedupe), and the
storage backoffs."""

from __future__ import annotations

import logging
import time
from collections import OrderedDict, deque
from concurrent.futures import Future
from dataclasses import dataclass, field

from hsx.runtime.errors import HsxError
from hsx.schemas import HiddenStatesReady
from hsx.schemas.dataset_codec import DatasetCodec
from hsx.schemas.keys import token_key
from hsx.sink.assembler import DEFAULT_MAX_SAMPLE_BYTES, Assembler, Staged
from hsx.sink.keys import KeyIndex, load_keys
from hsx.dataset.index import read_index
from hsx.dataset.shards import (
    INDEX, SHARDS, OpenShard, Spooling, partition_prefix, partition_stems, prefixed_stem, remove_orphans,
    remove_stale_temp_files, shard_keys,
)
from hsx.dataset.storage import Storage

log = logging.getLogger(__name__)

_FIRST_BACKOFF, _MAX_BACKOFF = 0.5, 30.0
_CACHED_INDEXES = 2
"""Parsed shard indexes kept for duplicates: a replay meets its duplicates shard
after shard, so each index is parsed once, and at most two are held."""


class DatasetDamaged(HsxError):
    """A key file names a shard whose index cannot be read: the dataset was
    changed by hand. Raised rather than guessed around: the sample may be stored."""


@dataclass
class Backoff:
    """The wait after a storage error: from 0.5 s, doubling up to 30 s; a success resets it."""

    delay: float = _FIRST_BACKOFF
    retry_at: float = 0.0

    def ready(self, now: float | None = None) -> bool:
        """False while the wait runs."""
        return (time.monotonic() if now is None else now) >= self.retry_at

    def failed(self) -> float:
        """Start (or double) the wait; returns its seconds."""
        waited = self.delay
        self.retry_at = time.monotonic() + waited
        self.delay = min(self.delay * 2, _MAX_BACKOFF)
        return waited

    def reset(self) -> None:
        self.delay = _FIRST_BACKOFF


@dataclass(frozen=True)
class StoredCopy:
    """The copy of a request the dataset (or a shard not yet written) already holds."""

    event: HiddenStatesReady | None
    """Its ready event; None while it waits in a shard not yet written (its event comes with the shard)."""
    same_tokens: bool
    """Whether it holds the same token ids: a duplicate, else a conflict."""


@dataclass
class PartitionState:
    topic: str
    partition: int
    assembler: Assembler
    shard: OpenShard
    keys: KeyIndex
    """Samples already in the dataset, as compact keys: later copies are duplicates."""
    closed: deque[OpenShard] = field(default_factory=deque)
    """Closed shards not yet in the dataset, oldest first. The shard writer writes
    the first (``writing``), one at a time, so shards land in name order."""
    writing: Future[list[HiddenStatesReady]] | None = None
    """The write of ``closed[0]`` in the writer thread; None between attempts."""
    republish: list[tuple[HiddenStatesReady, list[int]]] = field(default_factory=list)
    """Ready events of duplicates, published again (consumers de-duplicate by event
    id): a crash between writing a shard and publishing its events must not leave
    trainers without them."""
    write_backoff: Backoff = field(default_factory=Backoff)
    unfetched: list[Staged] = field(default_factory=list)
    """By-reference manifests whose payload store did not answer, fetched again
    after ``fetch_backoff``; nothing past them is committed meanwhile."""
    fetch_backoff: Backoff = field(default_factory=Backoff)
    spooling: Spooling | None = None
    """How its open shards stream to their file (None: held until they close)."""
    _indexes: OrderedDict[int, dict[str, HiddenStatesReady]] = field(default_factory=OrderedDict)

    @classmethod
    def load(cls, storage: Storage, topic: str, partition: int, incomplete_timeout: float,
             stored_as: DatasetCodec = DatasetCodec.RAW,
             max_sample_bytes: int = DEFAULT_MAX_SAMPLE_BYTES, spooling: Spooling | None = None) -> PartitionState:
        """The partition as the dataset left it: a shard a crash left without an
        index is removed (its records are replayed), and so are the temp files of
        shards it was writing; indexed samples are known. Costs a listing of the
        partition's index and key files and a read per key file (see
        :mod:`hsx.sink.keys`), nothing per sample."""
        prefix = partition_prefix(topic, partition)
        indexed = partition_stems(storage, INDEX, prefix, ".json")
        for orphan in remove_orphans(storage, prefix, indexed[-1] if indexed else None):
            log.warning("removed %s: written before a crash, never indexed (its records will be replayed)", orphan)
        if spooling is not None:
            for stale in remove_stale_temp_files(spooling.shards_folder, prefix):
                log.warning("removed %s/%s: a shard being written before a crash", SHARDS, stale)
        return cls(topic, partition, Assembler(incomplete_timeout, stored_as, max_sample_bytes),
                   OpenShard(topic, partition, spooling), load_keys(storage, prefix, indexed), spooling=spooling)

    @property
    def key(self) -> tuple[str, int]:
        return (self.topic, self.partition)

    @property
    def buffered_bytes(self) -> int:
        return self.assembler.pending_bytes + self.shard.held_bytes + sum(shard.held_bytes for shard in self.closed)

    @property
    def unwritten_samples(self) -> int:
        return len(self.shard.samples) + sum(len(shard.samples) for shard in self.closed)

    def stored_copy(self, storage: Storage, request_id: str, token_ids: list[int]) -> StoredCopy | None:
        """The copy of ``request_id`` the partition already holds (in the dataset,
        or in a shard not yet written), or None for a new request. Reads the
        shard's index only when the keys match."""
        for unwritten in (self.shard, *self.closed):
            copy = unwritten.by_id.get(request_id)
            if copy is not None:
                return StoredCopy(None, copy.manifest.token_ids == token_ids)
        candidates = self.keys.candidates(request_id)
        if not candidates:
            return None
        tokens = token_key(token_ids)
        for stored_tokens, first_offset in candidates:
            event = self._events(storage, first_offset).get(request_id)
            if event is not None:  # else another id with the same 64-bit key
                return StoredCopy(event, stored_tokens == tokens)
        return None

    def _events(self, storage: Storage, first_offset: int) -> dict[str, HiddenStatesReady]:
        if first_offset in self._indexes:
            self._indexes.move_to_end(first_offset)
            return self._indexes[first_offset]
        path = f"{INDEX}/{prefixed_stem(partition_prefix(self.topic, self.partition), first_offset)}.json"
        try:
            index = read_index(storage, path)
        except FileNotFoundError as exc:
            raise DatasetDamaged(f"the dedupe keys name {path}, which is missing: restore it, or delete the "
                                 f"partition's keys/ files so they are rebuilt from the indexes") from exc
        events = {e.request_id: e for e in index.events}
        self._indexes[first_offset] = events
        if len(self._indexes) > _CACHED_INDEXES:
            self._indexes.popitem(last=False)
        return events

    # -- closing and writing shards, with backoff after storage errors ---------------------

    def close_shard(self) -> None:
        """The open shard joins the closed ones; a new one opens."""
        self.closed.append(self.shard)
        self.shard = OpenShard(self.topic, self.partition, self.spooling)

    def written(self) -> OpenShard:
        """The first closed shard is durable and indexed: its samples are known.
        Returns it."""
        shard = self.closed.popleft()
        shard.discard()
        self.write_backoff.reset()
        self.keys.add(shard_keys(shard))
        return shard

    def drop(self) -> None:
        """The partition leaves this sink: its shards not written let go of their
        spools (their records are replayed by the next owner)."""
        for shard in (self.shard, *self.closed):
            shard.discard()
