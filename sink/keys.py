"""What one partition already holds, for dedupe, in 24 bytes a sample.

On assignment the sink reads the partition's key files (``hsx.schemas.keys``): its
roll-up, plus one small file per shard indexed since, and keeps them as three
sorted numpy arrays. Nothing per sample is parsed; one read per file. A shard
indexed before key files existed gets its key file built once, from its index
and its token ids.

When a partition's shards outnumber :data:`ROLLUP_AFTER` files beyond its
roll-up, the load writes a new roll-up of everything it read, so the next load
reads a few files however many shards the partition holds (a partition of many
small shards, e.g. under ``--flush-when-idle``, would otherwise cost a read per
shard).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import numpy as np

from hsx.dataset.index import read_index, stored_token_ids
from hsx.dataset.shards import INDEX, KEYS, partition_stems, stem_offset
from hsx.dataset.storage import Storage
from hsx.schemas.keys import KEY_RECORD, decode_keys, encode_keys, request_key, token_key

log = logging.getLogger(__name__)

ROLLUP_AFTER = 32
"""Key files read beyond the roll-up that make a load write a new one."""
_MERGE_AFTER = 65_536
"""Keys added since the load that are merged into the sorted arrays at once:
bounded, so the dict they wait in never grows with the dataset."""


@dataclass
class KeyIndex:
    """The keys of a partition's stored samples: sorted by request key, plus the
    few added since the last merge."""

    requests: np.ndarray = field(default_factory=lambda: np.empty(0, "<u8"))
    tokens: np.ndarray = field(default_factory=lambda: np.empty(0, "<u8"))
    shards: np.ndarray = field(default_factory=lambda: np.empty(0, "<u8"))
    recent: list[np.ndarray] = field(default_factory=list)
    recent_by_request: dict[int, list[tuple[int, int]]] = field(default_factory=dict)

    @classmethod
    def of(cls, records: np.ndarray) -> KeyIndex:
        """An index over ``records`` (dtype ``KEY_RECORD``, any order)."""
        order = np.argsort(records["request"], kind="stable")
        return cls(np.ascontiguousarray(records["request"][order]), np.ascontiguousarray(records["tokens"][order]),
                   np.ascontiguousarray(records["shard"][order]))

    def __len__(self) -> int:
        return len(self.requests) + sum(len(r) for r in self.recent)

    @property
    def nbytes(self) -> int:
        return self.requests.nbytes + self.tokens.nbytes + self.shards.nbytes

    def candidates(self, request_id: str) -> list[tuple[int, int]]:
        """(token key, shard first offset) of every stored sample whose request
        key is ``request_id``'s: usually none or one; more only on a hash
        collision, which the shard's index resolves."""
        key = request_key(request_id)
        wanted = np.uint64(key)  # as uint64: a Python int above 2**63 would be compared as a float
        lo, hi = np.searchsorted(self.requests, wanted, "left"), np.searchsorted(self.requests, wanted, "right")
        found = [(int(self.tokens[i]), int(self.shards[i])) for i in range(lo, hi)]
        return found + self.recent_by_request.get(key, [])

    def add(self, records: np.ndarray) -> None:
        """Samples just indexed."""
        self.recent.append(records)
        for r in records:
            self.recent_by_request.setdefault(int(r["request"]), []).append((int(r["tokens"]), int(r["shard"])))
        if len(self.recent_by_request) >= _MERGE_AFTER:
            self._merge()

    def records(self) -> np.ndarray:
        """Every key, as ``KEY_RECORD`` records sorted by request key."""
        self._merge()
        return self._sorted_records()

    def _sorted_records(self) -> np.ndarray:
        out = np.empty(len(self.requests), KEY_RECORD)
        out["request"], out["tokens"], out["shard"] = self.requests, self.tokens, self.shards
        return out

    def _merge(self) -> None:
        if not self.recent:
            return
        merged = KeyIndex.of(np.concatenate([self._sorted_records(), *self.recent]))
        self.requests, self.tokens, self.shards = merged.requests, merged.tokens, merged.shards
        self.recent, self.recent_by_request = [], {}


def rollup_path(prefix: str) -> str:
    return f"{KEYS}/{prefix}rollup.keys"


def load_keys(storage: Storage, prefix: str, indexed: list[str]) -> KeyIndex:
    """The keys of the partition whose indexed shards are ``indexed`` (stems, sorted)."""
    parts, covered = [], set()
    rollup = _read_rollup(storage, prefix)
    if rollup is not None:
        parts.append(rollup)
        covered = set(np.unique(rollup["shard"]).tolist())
    keyed = set(partition_stems(storage, KEYS, prefix, ".keys"))
    read = 0
    for stem in indexed:
        if stem_offset(stem) in covered:
            continue
        parts.append(_shard_keys(storage, stem, stem in keyed))
        read += 1
    index = KeyIndex.of(np.concatenate(parts) if parts else np.empty(0, KEY_RECORD))
    del parts  # the files' bytes: only the sorted arrays stay
    if read >= ROLLUP_AFTER:
        _write_derived(storage, rollup_path(prefix), index.records())
        log.info("rolled up the keys of %d shards of %s* (%d samples)", read, prefix, len(index))
    return index


def _write_derived(storage: Storage, path: str, records: np.ndarray) -> None:
    """Key files are derived from the indexes: failing to write one (a full or
    read-only disk) only costs the next load the work again, so it must not stop
    the assignment."""
    try:
        storage.write_atomic(path, encode_keys(records))
    except OSError as exc:
        log.warning("cannot write %s (the next assignment builds it again): %s", path, exc)


def _read_rollup(storage: Storage, prefix: str) -> np.ndarray | None:
    path = rollup_path(prefix)
    if path not in storage.list(KEYS, starting=path.rsplit("/", 1)[-1]):
        return None
    try:
        return decode_keys(storage.read(path), path)
    except ValueError as exc:  # derived data: the per-shard files and indexes still hold everything
        log.warning("ignoring %s (%s): reading the shards' key files instead", path, exc)
        return None


def _shard_keys(storage: Storage, stem: str, keyed: bool) -> np.ndarray:
    path = f"{KEYS}/{stem}.keys"
    if keyed:
        try:
            return decode_keys(storage.read(path), path)
        except ValueError as exc:
            log.warning("rebuilding %s from its index: %s", path, exc)
    # A shard indexed before key files existed (or with a damaged one): once.
    index = read_index(storage, f"{INDEX}/{stem}.json")
    records = np.array([(request_key(e.request_id), token_key(stored_token_ids(storage, e)), index.first_offset)
                        for e in index.events], dtype=KEY_RECORD)
    _write_derived(storage, path, records)
    return records
