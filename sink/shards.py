"""Shards: many samples per safetensors file, written durably, then indexed.

Layout of a dataset directory::

    shards/<topic>-<partition>-<first offset>.safetensors   # tensors <request_id>/hidden_states, /token_ids, /loss_mask
    index/<same name>.json                                   # schemas.ShardIndex: the ready event of every sample

Names derive from (topic, partition, offset of the first sample's manifest), so a
replay after a crash rewrites the same file instead of adding one.
"""

from __future__ import annotations

import re
import time
import warnings
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from runtime.tensors import TORCH_DTYPES
from schemas import HiddenStatesReady, ShardIndex, TensorNames, ready_event_id
from schemas.codec import checksum
from schemas.shard import ShardMetadata
from sink.assembler import Sample
from sink.storage import Storage

SHARDS = "shards"
INDEX = "index"
_UNSAFE = re.compile(r"[^A-Za-z0-9._-]")


def shard_stem(topic: str, partition: int, first_offset: int) -> str:
    return f"{_UNSAFE.sub('_', topic)}-{partition:04d}-{first_offset:020d}"


def partition_prefix(topic: str, partition: int) -> str:
    return f"{_UNSAFE.sub('_', topic)}-{partition:04d}-"


@dataclass
class OpenShard:
    """Samples of one partition waiting for their shard to close."""

    topic: str
    partition: int
    samples: list[Sample] = field(default_factory=list)
    nbytes: int = 0
    opened_at: float = field(default_factory=time.monotonic)
    last_added_at: float = field(default_factory=time.monotonic)

    def accepts(self, sample: Sample) -> bool:
        """One shard holds samples of one model, layer set, dtype and width, so its
        metadata describes all of them."""
        if not self.samples:
            return True
        first, new = self.samples[0].manifest, sample.manifest
        return (first.model, first.layer_ids, first.dtype, first.hidden_size) == (
            new.model, new.layer_ids, new.dtype, new.hidden_size)

    def add(self, sample: Sample) -> None:
        self.last_added_at = time.monotonic()
        if not self.samples:
            self.opened_at = self.last_added_at
        self.samples.append(sample)
        self.nbytes += len(sample.hidden_states)

    @property
    def stem(self) -> str:
        return shard_stem(self.topic, self.partition, self.samples[0].manifest_offset)


def write_shard(storage: Storage, dataset: str, shard: OpenShard) -> list[HiddenStatesReady]:
    """Write the shard, then its index, each durably; return the ready events."""
    stem = shard.stem
    shard_path = f"{SHARDS}/{stem}.safetensors"
    tensors: dict[str, torch.Tensor] = {}
    events = []
    for sample in shard.samples:
        m = sample.manifest
        rid = m.request_id
        names = TensorNames(hidden_states=f"{rid}/hidden_states", token_ids=f"{rid}/token_ids",
                            loss_mask=f"{rid}/loss_mask" if m.loss_mask_spans is not None else None)
        tensors[names.hidden_states] = _read_only_view(sample.hidden_states, TORCH_DTYPES[m.dtype]).view(
            m.captured_tokens, len(m.layer_ids), m.hidden_size)
        tensors[names.token_ids] = torch.tensor(m.token_ids, dtype=torch.int64)
        if names.loss_mask is not None:
            mask = torch.zeros(m.num_tokens, dtype=torch.bool)
            for start, end in m.loss_mask_spans or []:
                mask[start:end] = True
            tensors[names.loss_mask] = mask
        events.append(HiddenStatesReady(
            event_id=ready_event_id(dataset, rid), request_id=rid, shard=shard_path, tensors=names,
            num_tokens=m.num_tokens, layer_ids=m.layer_ids, dtype=m.dtype, hidden_size=m.hidden_size,
            model=m.model, checksum=checksum(sample.hidden_states), metadata=m.metadata, generation=m.generation,
            capture=m.capture))
    first = shard.samples[0].manifest
    metadata = ShardMetadata(
        model=first.model, layer_ids=first.layer_ids, dtype=first.dtype, hidden_size=first.hidden_size,
        request_ids=[s.manifest.request_id for s in shard.samples],
    ).to_safetensors()
    storage.write_atomic_with(shard_path, lambda tmp: _save(tensors, metadata, tmp))
    index = ShardIndex(shard=shard_path, topic=shard.topic, partition=shard.partition,
                       first_offset=shard.samples[0].manifest_offset, events=events)
    storage.write_atomic(f"{INDEX}/{stem}.json", index.model_dump_json().encode())
    return events


def _save(tensors: dict[str, torch.Tensor], metadata: dict[str, str], path: Path) -> None:
    try:
        save_file(tensors, path, metadata)
    except SafetensorError as exc:  # safetensors wraps I/O errors (full disk, ...): callers retry OSErrors
        raise OSError(f"cannot write {path.name}: {exc}") from exc


def _read_only_view(data: bytes, dtype: torch.dtype) -> torch.Tensor:
    """A tensor over ``data`` without copying it. torch warns that the buffer is
    not writable; the view is only read (serialized), so that is fine."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(data, dtype=dtype)


def read_indexes(storage: Storage, prefix: str = "") -> list[ShardIndex]:
    """Every shard index (optionally only those whose name starts with ``prefix``)."""
    return [
        ShardIndex.model_validate_json(storage.read(path))
        for path in storage.list(INDEX)
        if path.rsplit("/", 1)[-1].startswith(prefix) and path.endswith(".json")
    ]


def remove_orphans(storage: Storage, prefix: str) -> list[str]:
    """Delete shards without an index (a crash between the two writes); the records
    they held were never committed, so they come back on replay."""
    indexed = {p.rsplit("/", 1)[-1].removesuffix(".json") for p in storage.list(INDEX)}
    orphans = [
        path for path in storage.list(SHARDS)
        if path.rsplit("/", 1)[-1].startswith(prefix)
        and path.rsplit("/", 1)[-1].removesuffix(".safetensors") not in indexed
    ]
    for path in orphans:
        storage.delete(path)
    return orphans


def stored_token_ids(storage: Storage, event: HiddenStatesReady) -> list[int]:
    """The token ids of a sample already in the dataset."""
    return _open_shard(str(storage.local_path(event.shard))).get_tensor(event.tensors.token_ids).tolist()


@lru_cache(maxsize=4)
def _open_shard(path: str):  # type: ignore[no-untyped-def]
    # Only duplicates look samples up, and a replay meets them shard after shard:
    # keeping the last few open spares re-reading a large header per sample.
    return safe_open(path, framework="pt")
