"""Shards: many samples per safetensors file, written durably, then indexed.

Layout of a dataset directory::

    shards/<topic>-<partition>-<first offset>.safetensors   # tensors <request_id>/hidden_states, /token_ids, /loss_mask
                                                             # (hidden_states encoded per hsx.dataset.encoding)
    keys/<same name>.keys                                    # hsx.schemas.keys: the samples' dedupe keys
    index/<same name>.json                                   # hsx.schemas.ShardIndex: the ready event of every sample

Written in that order, each durably: the index is what makes a shard part of the
dataset, so a crash leaves at most a shard and its keys without an index, past
the partition's last indexed shard (see :func:`remove_orphans`).

Names derive from (topic, partition, offset of the first sample's manifest), so a
replay after a crash rewrites the same file instead of adding one, and a
partition's names sort in the order its shards were written.
"""

from __future__ import annotations

import logging
import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from hsx.codecs.block import checksum
from hsx.dataset.encoding import stored_tensor
from hsx.dataset.safetensors_io import write_safetensors
from hsx.dataset.sample import FileRange, Pieces, Sample
from hsx.dataset.spool import ShardSpool, fixed_head_bytes, head_bytes, room_for
from hsx.dataset.storage import Storage
from hsx.schemas import HiddenStatesReady, ShardIndex, SourceRef, TensorNames, ready_event_id
from hsx.schemas.keys import KEY_RECORD, encode_keys, request_key, token_key
from hsx.schemas.shard import ShardMetadata

if TYPE_CHECKING:  # torch is imported where tensors are made: `hsx.open_dataset` imports without it
    import torch

SHARDS = "shards"
INDEX = "index"
KEYS = "keys"
TOPICS = "topics"
DATASET_FOLDERS = (SHARDS, INDEX, KEYS, TOPICS)
"""Everything the sink writes at a dataset's root (``logs`` is ``hsx run``'s)."""
log = logging.getLogger(__name__)
_UNSAFE = re.compile(r"[^A-Za-z0-9._-]")
_OFFSET_DIGITS = 20


def shard_stem(topic: str, partition: int, first_offset: int) -> str:
    return prefixed_stem(partition_prefix(topic, partition), first_offset)


def prefixed_stem(prefix: str, first_offset: int) -> str:
    """The name of the shard of the partition ``prefix`` that starts at ``first_offset``."""
    return f"{prefix}{first_offset:0{_OFFSET_DIGITS}d}"


def partition_prefix(topic: str, partition: int) -> str:
    return f"{safe_name(topic)}-{partition:04d}-"


def safe_name(topic: str) -> str:
    """``topic`` as a file name (Kafka allows only ``.``, ``_``, ``-`` besides
    alphanumerics; anything else, e.g. from a hand-made directory, becomes ``_``)."""
    return _UNSAFE.sub("_", topic)


@dataclass(frozen=True)
class Spooling:
    """When a partition's open shards stream to their file
    (:mod:`hsx.dataset.spool`): datasets on a file system only."""

    shards_folder: Path
    after_bytes: int = 64 << 20
    """A shard streams once its samples hold this many bytes in memory; others
    are written when they close (a file at once, no room kept), among them
    shards of samples left in a staging directory's files, which hold none."""
    max_shard_bytes: int = 1 << 30
    """The largest shard the partition writes: what the room is sized for."""


@dataclass
class OpenShard:
    """Samples of one partition waiting for their shard to close."""

    topic: str
    partition: int
    spooling: Spooling | None = None
    """Streamed to its file past a size (local datasets); None: held until it closes."""
    samples: list[Sample] = field(default_factory=list)
    by_id: dict[str, Sample] = field(default_factory=dict)
    """The same samples by request id: each new sample is looked up here."""
    nbytes: int = 0
    """The bytes its samples store: its shard's size, near enough."""
    head_bytes: int = 0
    """A bound on its header and token ids: what a streamed shard must keep room for."""
    opened_at: float = field(default_factory=time.monotonic)
    last_added_at: float = field(default_factory=time.monotonic)
    spool: ShardSpool | None = None
    _held: int = 0

    @property
    def held_bytes(self) -> int:
        """The bytes of it held in memory (the rest is in files: :class:`FileRange`)."""
        return self._held + (self.spool.buffer_bytes if self.spool is not None else 0)

    @property
    def streaming(self) -> bool:
        return self.spool is not None and not self.spool.broken

    def accepts(self, sample: Sample) -> bool:
        """One shard holds samples of one model, layer set, dtype, width and
        dataset codec, so its metadata describes all of them; a streamed shard
        only as many as its room has space for."""
        if not self.samples:
            return True
        first, new = self.samples[0].manifest, sample.manifest
        if self.streaming and self.head_bytes + head_bytes(new) > self.spool.room:  # type: ignore[union-attr]
            return False
        return (first.model, first.layer_ids, first.dtype, first.hidden_size, self.samples[0].codec) == (
            new.model, new.layer_ids, new.dtype, new.hidden_size, sample.codec)

    def add(self, sample: Sample) -> None:
        self.last_added_at = time.monotonic()
        if not self.samples:
            self.opened_at = self.last_added_at
            self.head_bytes = fixed_head_bytes(_metadata(sample, []))
        self.samples.append(sample)
        self.by_id[sample.manifest.request_id] = sample
        self.nbytes += len(sample.hidden_states)
        self.head_bytes += head_bytes(sample.manifest)
        self._held += sample.held_bytes
        if self.streaming:
            self._stream(sample)
        elif self.spool is None and self.spooling is not None and self._held >= self.spooling.after_bytes:
            self._start_spool(self.spooling)

    def due(self, now: float, max_age: float, when_idle: float | None) -> bool:
        """Old enough, or idle long enough (when ``when_idle`` is set), to close."""
        return self.due_in(now, max_age, when_idle) <= 0

    def due_in(self, now: float, max_age: float, when_idle: float | None) -> float:
        """Seconds from ``now`` until it is :meth:`due` (0 or less: it is)."""
        at = self.opened_at + max_age
        if when_idle is not None:
            at = min(at, self.last_added_at + when_idle)
        return at - now

    def discard(self) -> None:
        """Let go of its spool (written or dropped: see :meth:`ShardSpool.discard`)."""
        if self.spool is not None:
            self.spool.discard()

    @property
    def stem(self) -> str:
        return shard_stem(self.topic, self.partition, self.samples[0].manifest_offset)

    def _start_spool(self, spooling: Spooling) -> None:
        room = room_for(self.head_bytes, self.nbytes, spooling.max_shard_bytes)
        try:
            self.spool = ShardSpool.start(spooling.shards_folder / f"{self.stem}.safetensors", room)
        except OSError as exc:
            log.warning("shard %s is held in memory: cannot stream it to a file (%s)", self.stem, exc)
            self.spooling = None
            return
        for sample in self.samples:
            if not self.streaming:
                break
            self._stream(sample)

    def _stream(self, sample: Sample) -> None:
        """Step 2 of :mod:`hsx.dataset.spool` (a spool that fails breaks: the rest stays held)."""
        assert self.spool is not None
        if sample.checksum is None:  # a raw sample's checksum is of the bytes about to leave memory
            sample.checksum = _checksum(sample)
        try:
            self._held -= self.spool.take(sample)
        except OSError as exc:
            log.warning("shard %s: cannot stream to %s any more, holding the rest in memory (%s)",
                        self.stem, self.spool.path, exc)


def write_shard(storage: Storage, dataset: str, shard: OpenShard) -> list[HiddenStatesReady]:
    """Write the shard, then its key file, then its index (which makes it part of
    the dataset), each durably; return the ready events. A streamed shard lands
    from its spool; if that fails it is written as a held one."""
    import torch

    stem = shard.stem
    shard_path = f"{SHARDS}/{stem}.safetensors"
    tensors: dict[str, torch.Tensor | Pieces | FileRange] = {}
    events = []
    for sample in shard.samples:
        m = sample.manifest
        rid = m.request_id
        names = TensorNames(hidden_states=f"{rid}/hidden_states", token_ids=f"{rid}/token_ids",
                            loss_mask=f"{rid}/loss_mask" if m.loss_mask_spans is not None else None)
        tensors[names.hidden_states] = stored_tensor(sample)
        tensors[names.token_ids] = torch.tensor(m.token_ids, dtype=torch.int64)
        if names.loss_mask is not None:
            mask = torch.zeros(m.num_tokens, dtype=torch.bool)
            for start, end in m.loss_mask_spans or []:
                mask[start:end] = True
            tensors[names.loss_mask] = mask
        events.append(HiddenStatesReady(
            event_id=ready_event_id(dataset, rid), request_id=rid, shard=shard_path, tensors=names,
            num_tokens=m.num_tokens, layer_ids=m.layer_ids, dtype=m.dtype, hidden_size=m.hidden_size,
            model=m.model, checksum=sample.checksum or _checksum(sample), metadata=m.metadata,
            generation=m.generation, capture=m.capture, codec=sample.codec,
            shape=(m.captured_tokens, len(m.layer_ids), m.hidden_size),
            source_request_id=m.source.request_id if isinstance(m.source, SourceRef) else None,
            speculation=m.speculation))
    metadata = _metadata(shard.samples[0], [s.manifest.request_id for s in shard.samples])
    if shard.spool is None or not shard.spool.landed_shard(tensors, metadata):
        with storage.open_atomic(shard_path, cache=False) as out:  # read back elsewhere, if here not soon
            write_safetensors(out, tensors, metadata)
    storage.write_atomic(f"{KEYS}/{stem}.keys", encode_keys(shard_keys(shard)))
    index = ShardIndex(shard=shard_path, topic=shard.topic, partition=shard.partition,
                       first_offset=shard.samples[0].manifest_offset, events=events)
    storage.write_atomic(f"{INDEX}/{stem}.json", index.model_dump_json().encode())
    return events


def _metadata(sample: Sample, request_ids: list[str]) -> dict[str, str]:
    """The safetensors metadata of a shard whose first sample is ``sample``."""
    first = sample.manifest
    return ShardMetadata(model=first.model, layer_ids=first.layer_ids, dtype=first.dtype, hidden_size=first.hidden_size,
                         request_ids=request_ids, codec=sample.codec).to_safetensors()


def _checksum(sample: Sample) -> str:
    stored = sample.hidden_states
    if isinstance(stored, FileRange):  # only kept as one with its checksum
        raise ValueError(f"{sample.manifest.request_id}: stored from a file, without its checksum")
    return checksum(*stored.parts) if isinstance(stored, Pieces) else checksum(stored)


def shard_keys(shard: OpenShard) -> np.ndarray:
    """The dedupe keys of the shard's samples (see :mod:`hsx.schemas.keys`)."""
    first = shard.samples[0].manifest_offset
    return np.array([(request_key(s.manifest.request_id), token_key(s.manifest.token_ids), first)
                     for s in shard.samples], dtype=KEY_RECORD)


def partition_stems(storage: Storage, folder: str, prefix: str, suffix: str, after: str = "") -> list[str]:
    """The stems of one partition's files in ``folder`` (``prefix``: see
    :func:`partition_prefix`), sorted, optionally only those after the stem
    ``after``. Only exact shard names count: ``a-0001-`` must not take the
    files of a topic named ``a-0001-x``."""
    return [
        stem for path in storage.list(folder, starting=prefix, after=f"{after}{suffix}" if after else "")
        if path.endswith(suffix)
        and len(stem := path.rsplit("/", 1)[-1].removesuffix(suffix)) == len(prefix) + _OFFSET_DIGITS
        and stem[len(prefix):].isdigit()
    ]


def stem_offset(stem: str) -> int:
    """The first offset a shard's name carries."""
    return int(stem[-_OFFSET_DIGITS:])


def remove_orphans(storage: Storage, prefix: str, last_indexed: str | None) -> list[str]:
    """Delete the partition's shards and key files that sort after its last
    indexed shard (``last_indexed``, a stem, or None for a partition without
    one): a crash after writing them and before their index. Only there can a
    crash leave them (a partition's shards are written in name order, and each
    assignment cleans up before writing), so only there is listed. Their records
    were never committed, so they come back on replay. (Should a name before the
    last index ever be left unindexed, readers never see it, as they go by the
    indexes, and the replay of its records writes the same name again.)"""
    after = last_indexed or ""
    orphans = [f"{folder}/{stem}{suffix}" for folder, suffix in ((SHARDS, ".safetensors"), (KEYS, ".keys"))
               for stem in partition_stems(storage, folder, prefix, suffix, after)]
    for path in orphans:
        storage.delete(path)
    return orphans


def remove_stale_temp_files(shards_folder: Path, prefix: str) -> list[str]:
    """Delete the temp files a crash left in ``shards_folder`` for the partition
    ``prefix``: shards being written or streamed (:mod:`hsx.dataset.spool`); none
    is, while the partition is being loaded. Returns their names."""
    if not shards_folder.is_dir():
        return []
    start = len(prefix) + 1
    with os.scandir(shards_folder) as entries:  # exact names only: a-0001- must not take a-0001-x-0001-'s
        stale = [e.name for e in entries if e.name.startswith(f".{prefix}") and e.name.endswith(".tmp")
                 and e.name[start:start + _OFFSET_DIGITS].isdigit()
                 and e.name[start + _OFFSET_DIGITS:start + _OFFSET_DIGITS + 1] == "."]
    for name in stale:
        (shards_folder / name).unlink(missing_ok=True)
    return stale
