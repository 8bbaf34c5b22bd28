"""What a shard file says about itself, and the one wire ↔ torch dtype mapping the
writers and readers of tensors share."""

from __future__ import annotations

from pathlib import Path

import pytest
from safetensors import safe_open

from runtime.tensors import TORCH_DTYPES, WIRE_DTYPES
from schemas import DType
from schemas.shard import ShardMetadata
from sink.assembler import Assembler, Sample
from sink.shards import OpenShard, write_shard
from sink.storage import LocalStorage
from tests.unit.test_assembler import HIDDEN, feed, records


def test_every_wire_dtype_maps_to_torch_and_back() -> None:
    assert set(TORCH_DTYPES) == set(DType)
    assert {WIRE_DTYPES[t] for t in TORCH_DTYPES.values()} == set(DType)
    assert all(WIRE_DTYPES[TORCH_DTYPES[d]] is d for d in DType)


def test_shard_header_metadata_is_the_contract(tmp_path: Path) -> None:
    shard = OpenShard(topic="hidden_states.blocks", partition=0)
    for request_id, first_offset in (("a", 0), ("b", 100)):
        (sample,) = feed(Assembler(), records(request_id, tokens=5, first_offset=first_offset)[0])
        assert isinstance(sample, Sample)
        shard.add(sample)
    storage = LocalStorage(tmp_path)
    (event, _) = write_shard(storage, "ds", shard)
    with safe_open(str(storage.local_path(event.shard)), framework="pt") as handle:
        raw = handle.metadata()
    # Pinned as bytes on disk: trainers may read these keys without hsx.
    assert raw == {"schema_version": "1", "model": "m", "layer_ids": "[1,3]", "dtype": "float32",
                   "hidden_size": str(HIDDEN), "request_ids": '["a","b"]'}
    assert ShardMetadata.from_safetensors(raw) == ShardMetadata(
        model="m", layer_ids=[1, 3], dtype=DType.FLOAT32, hidden_size=HIDDEN, request_ids=["a", "b"])


@pytest.mark.parametrize("key, value", [("hidden_size", "0"), ("layer_ids", "[1,"), ("dtype", "int8"),
                                        ("request_ids", '["../x"]'), ("schema_version", "2")])
def test_bad_shard_metadata_is_refused(key: str, value: str) -> None:
    good = ShardMetadata(model="m", layer_ids=[0], dtype=DType.BFLOAT16, hidden_size=8, request_ids=["a"])
    with pytest.raises(ValueError):
        ShardMetadata.from_safetensors({**good.to_safetensors(), key: value})
