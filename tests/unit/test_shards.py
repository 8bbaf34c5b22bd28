"""What a shard file says about itself, and the one wire ↔ torch dtype mapping the
writers and readers of tensors share."""

from __future__ import annotations

from pathlib import Path

import pytest
from safetensors import safe_open

from hsx.dataset.encoding import encode
from hsx.dataset.sample import Sample
from hsx.dataset.shards import OpenShard, write_shard
from hsx.dataset.storage import LocalStorage
from hsx.runtime.tensors import TORCH_DTYPES, WIRE_DTYPES
from hsx.schemas import DType
from hsx.schemas.dataset_codec import DatasetCodec
from hsx.schemas.shard import ShardMetadata
from hsx.sink.assembler import Assembler
from tests.unit.test_assembler import HIDDEN, feed, records
from tests.unit.test_dataset_storage import assert_decoded


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
                   "hidden_size": str(HIDDEN), "request_ids": '["a","b"]', "codec": "raw"}
    assert ShardMetadata.from_safetensors(raw) == ShardMetadata(
        model="m", layer_ids=[1, 3], dtype=DType.FLOAT32, hidden_size=HIDDEN, request_ids=["a", "b"])
    # A shard written before dataset codecs has no codec key: raw.
    del raw["codec"]
    assert ShardMetadata.from_safetensors(raw).codec == "raw"


@pytest.mark.parametrize("key, value", [("hidden_size", "0"), ("layer_ids", "[1,"), ("dtype", "int8"),
                                        ("request_ids", '["../x"]'), ("schema_version", "2"),
                                        ("codec", "lz4"),
                                        ("layer_ids", "[" * 300 + "]" * 300)])  # deeper than orjson writes
def test_bad_shard_metadata_is_refused(key: str, value: str) -> None:
    good = ShardMetadata(model="m", layer_ids=[0], dtype=DType.BFLOAT16, hidden_size=8, request_ids=["a"])
    with pytest.raises(ValueError):
        ShardMetadata.from_safetensors({**good.to_safetensors(), key: value})


@pytest.mark.parametrize("codec", list(DatasetCodec))
def test_a_last_token_sample_is_stored_as_one_row(tmp_path: Path, codec: DatasetCodec) -> None:
    """``capture: last``: the blocks cover the final token only; the shard holds
    ``[1, L, H]`` beside every token id, and the reader returns it as such, in
    every dataset codec (a zstd block from token 6: byteplane-zstd re-encodes it)."""
    import torch

    from hsx.codecs.block import encode_block, read_header
    from hsx.dataset.reader import open_dataset
    from hsx.schemas import BlockRecordHeaders, BlockRef, Codec, Manifest, RecordKind, SourceRef
    from hsx.sink.assembler import Record

    row = torch.randn(1, 2, HIDDEN)
    value = encode_block(row.view(torch.uint8).numpy(), shape=(1, 2, HIDDEN), dtype=DType.FLOAT32, token_start=6,
                         codec=Codec.ZSTD)
    header, _ = read_header(value)
    attempt = "0" * 32
    manifest = Manifest(request_id="last", attempt_id=attempt, model="m", layer_ids=[1, 3], dtype=DType.FLOAT32,
                        hidden_size=HIDDEN, num_tokens=7, token_ids=list(range(7)), codec=Codec.ZSTD, capture="last",
                        blocks=[BlockRef(index=0, token_start=6, token_end=7, checksum=header.checksum,
                                         compressed_nbytes=len(value))],
                        source=SourceRef(topic="p", partition=0, offset=1))
    (sample,) = feed(Assembler(), [
        Record(0, b"last", value, BlockRecordHeaders(kind=RecordKind.BLOCK, attempt_id=attempt, block_index=0,
                                                     codec=Codec.ZSTD).to_kafka()),
        Record(1, b"last", manifest.model_dump_json().encode(),
               BlockRecordHeaders(kind=RecordKind.MANIFEST, attempt_id=attempt).to_kafka())])
    assert isinstance(sample, Sample)
    shard = OpenShard(topic="hidden_states.blocks", partition=0)
    shard.add(encode(sample, codec))
    (event,) = write_shard(LocalStorage(tmp_path), "ds", shard)
    assert (event.capture, event.num_tokens, event.codec, event.shape) == ("last", 7, codec, (1, 2, HIDDEN))
    stored = open_dataset(tmp_path)["last"]
    assert_decoded(row, stored["hidden_states"], codec)
    assert stored["token_ids"].tolist() == list(range(7))
