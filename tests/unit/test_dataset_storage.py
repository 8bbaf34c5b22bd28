"""Shards stored with each ``--dataset-codec`` (issue 16), through the sink's own
encode and write path, read back by every reader: lossless codecs bit-exact,
fp8 within the bound of ``schemas/fp8.py``; a damaged payload is one clear
error naming the shard and the sample; shards of different codecs mix."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import orjson
import pytest
import torch
from safetensors import safe_open

from hsx.cli import main
from hsx.codecs.fp8 import error_bound, scales_for
from hsx.dataset.encoding import CorruptSample, encode
from hsx.dataset.shard_reader import CorruptShard, RemoteShard
from hsx.dataset.reader import open_dataset
from hsx.dataset.sample import Sample
from hsx.dataset.shards import OpenShard, write_shard
from hsx.dataset.storage import LocalStorage
from hsx.local.training_data import TrainingDataSpec, write_training_dataset
from hsx.runtime.tensors import TORCH_DTYPES
from hsx.schemas import DType, HiddenStatesReady
from hsx.schemas.dataset_codec import DatasetCodec
from hsx.schemas.shard import ShardMetadata
from hsx.sink.assembler import Assembler
from hsx.trainer.dataset import HsxDataset
from hsx.trainer.samples import choose_layers, read_sample
from tests.unit.test_assembler import feed, records


def assert_decoded(original: torch.Tensor, decoded: torch.Tensor, codec: DatasetCodec) -> None:
    """``decoded`` is ``original`` bit for bit (lossless codecs), or within fp8's
    documented per-element bound (plus the narrowing's half unit for 16-bit
    dtypes). Shared with the real-sink round trips in tests/integration."""
    assert decoded.dtype == original.dtype and decoded.shape == original.shape
    if codec.lossless:
        assert torch.equal(decoded.view(torch.uint8), original.view(torch.uint8))
        return
    values = original.float().numpy()
    bound = error_bound(values, scales_for(values))
    if original.dtype != torch.float32:  # narrowing to bf16/fp16 adds its own half unit
        bound = bound + np.abs(decoded.float().numpy()) * 2.0**-8
    error = np.abs(decoded.float().numpy() - values)
    assert (error <= bound).all(), f"fp8 error {error.max()} beyond its bound"
    assert not torch.equal(decoded, original)  # it did quantize


def _store(root: Path, codec: DatasetCodec, *request_ids: str, first_offset: int = 0) -> dict[str, torch.Tensor]:
    """Samples of 10 tokens from real block records, encoded and written as the
    sink writes them; returns each one's original hidden states."""
    shard, originals = OpenShard(topic="hidden_states.blocks", partition=0), {}
    for k, request_id in enumerate(request_ids):
        recs, hidden = records(request_id, tokens=10, first_offset=first_offset + 10 * k)
        (sample,) = feed(Assembler(), recs)
        assert isinstance(sample, Sample)
        shard.add(encode(sample, codec))
        originals[request_id] = hidden
    write_shard(LocalStorage(root), root.name, shard)
    return originals


@pytest.mark.parametrize("codec", list(DatasetCodec))
def test_every_codec_reads_back_through_open_dataset(tmp_path: Path, codec: DatasetCodec) -> None:
    root = tmp_path / "ds"
    originals = _store(root, codec, "a", "b")
    dataset = open_dataset(root)
    for request_id, hidden in originals.items():
        event = dataset.event(request_id)
        assert (event.codec, event.shape, event.dtype) == (codec, tuple(hidden.shape), DType.FLOAT32)
        assert_decoded(hidden, dataset[request_id]["hidden_states"], codec)
    (shard,) = {dataset.event(r).shard for r in originals}
    with safe_open(str(root / shard), framework="pt") as handle:
        assert ShardMetadata.from_safetensors(handle.metadata()).codec is codec
        stored = handle.get_tensor("a/hidden_states")
    # raw stays the model's [T, L, H] tensor, so any safetensors reader loads it.
    assert (stored.dtype, stored.ndim) == ((torch.float32, 3) if codec is DatasetCodec.RAW else (torch.uint8, 1))


def test_byteplane_zstd_keeps_the_block_records_as_they_came() -> None:
    recs, _ = records("a", tokens=10)
    (sample,) = feed(Assembler(), recs)
    assert isinstance(sample, Sample)
    stored = encode(sample, DatasetCodec.BYTEPLANE_ZSTD)
    assert bytes(stored.hidden_states) == b"".join(r.value for r in recs[:-1]) and stored.records == []


@pytest.mark.parametrize("codec", [DatasetCodec.BYTEPLANE_ZSTD, DatasetCodec.FP8_ZSTD])
@pytest.mark.parametrize("dtype", [DType.BFLOAT16, DType.FLOAT32])
def test_hsx_dataset_and_export_decode_with_a_layer_subset(tmp_path: Path, codec: DatasetCodec, dtype: DType) -> None:
    spec = TrainingDataSpec(samples=6, dtype=dtype)
    write_training_dataset(tmp_path / "raw", spec)
    write_training_dataset(tmp_path / "coded", TrainingDataSpec(samples=6, dtype=dtype, codec=codec))
    raw, coded = (HsxDataset(tmp_path / name, layers=[3, 1]) for name in ("raw", "coded"))
    assert len(raw) == len(coded) == 6
    for row in range(len(raw)):
        assert_decoded(raw[row].hidden_states, coded[row].hidden_states, codec)
    assert main(["export", str(tmp_path / "out"), "--dataset", str(tmp_path / "coded"), "--layers", "3,1"]) == 0
    with safe_open(str(tmp_path / "out" / "hidden_states" / "hs_0.safetensors"), framework="pt") as handle:
        exported = handle.get_tensor("hidden_states")
    # The stored dtype, decoded: fp8 of a bf16 model exports as bf16.
    assert exported.dtype == TORCH_DTYPES[dtype]
    assert torch.equal(exported, coded[0].hidden_states)


def test_shards_of_different_codecs_read_as_one_dataset(tmp_path: Path) -> None:
    root = tmp_path / "ds"
    originals = {**_store(root, DatasetCodec.RAW, "r-1", "r-2"),
                 **_store(root, DatasetCodec.FP8, "f-1", first_offset=100),
                 **_store(root, DatasetCodec.BYTEPLANE_ZSTD, "z-1", first_offset=200)}
    dataset = open_dataset(root)
    assert sorted(dataset.request_ids()) == sorted(originals)
    for request_id, hidden in originals.items():
        assert_decoded(hidden, dataset[request_id]["hidden_states"], dataset.event(request_id).codec)


def _corrupt(root: Path, request_id: str) -> str:
    """Flip a byte inside ``request_id``'s stored hidden states; returns its shard."""
    event = open_dataset(root).event(request_id)
    with safe_open(str(root / event.shard), framework="pt") as handle:
        payload = handle.get_tensor(event.tensors.hidden_states).numpy().tobytes()
    data = bytearray((root / event.shard).read_bytes())
    at = data.find(payload) + len(payload) - 20  # in the last part: compressed planes, fp8 codes
    data[at] ^= 0x5A
    (root / event.shard).write_bytes(bytes(data))
    return event.shard


@pytest.mark.parametrize("codec", [DatasetCodec.BYTEPLANE_ZSTD, DatasetCodec.FP8, DatasetCodec.FP8_ZSTD])
def test_a_corrupt_payload_names_the_shard_and_the_sample(tmp_path: Path, codec: DatasetCodec,
                                                         capfd: pytest.CaptureFixture[str]) -> None:
    root = tmp_path / "ds"
    _store(root, codec, "good", "bad")
    shard = _corrupt(root, "bad")
    dataset = open_dataset(root)
    dataset["good"]  # the rest of the shard still reads
    with pytest.raises(CorruptSample, match=f"shard {shard}, sample bad: {codec.value} hidden states are corrupt"):
        dataset["bad"]
    assert main(["inspect", str(root), "--sample", "bad"]) == 1
    err = capfd.readouterr().err
    assert f"hsx inspect: shard {shard}, sample bad: " in err and "Traceback" not in err


_NAMES = {"hidden_states": "s-00000/hidden_states", "token_ids": "s-00000/token_ids", "loss_mask": "s-00000/loss_mask"}


@pytest.mark.parametrize("change, error, problem", [
    ({"dtype": "bfloat16"}, CorruptSample, r"s-00000/hidden_states is F32 \[\d+, 3, 4\] in the shard, its index entry says BF16"),
    ({"num_tokens": 99}, CorruptSample, r"sample s-00000: .*\[99"),
    ({"tensors": {**_NAMES, "token_ids": "s-00000/hidden_states"}}, CorruptSample, "hidden_states is F32 .* says I64"),
    ({"tensors": {**_NAMES, "loss_mask": "s-00000/nope"}}, CorruptShard, "s-00000/nope"),
])
def test_a_sample_whose_tensors_are_not_what_its_index_says_is_refused(
        tmp_path: Path, change: dict, error: type[Exception], problem: str, capfd: pytest.CaptureFixture[str]) -> None:
    """Every reader checks a stored tensor's dtype and shape against the index
    entry before reading or slicing it: the reader, the training dataset (its raw
    slice path), an object-store shard, and ``hsx inspect`` in one line."""
    root = tmp_path / "ds"
    write_training_dataset(root, TrainingDataSpec(samples=1, max_tokens=6, layer_ids=(1, 2, 3), hidden_size=4))
    (index_path,) = (root / "index").iterdir()
    index = orjson.loads(index_path.read_bytes())
    index["events"][0] |= change
    index_path.write_bytes(orjson.dumps(index))
    with pytest.raises(error, match=problem):
        open_dataset(root)["s-00000"]
    with pytest.raises(error, match=problem):
        HsxDataset(root, layers=[2, 1])[0]
    event = open_dataset(root).event("s-00000")
    with pytest.raises(error, match=problem):
        read_sample(RemoteShard(LocalStorage(root), event.shard), event, choose_layers([1, 2, 3], [2, 1]), "all")
    assert main(["inspect", str(root)]) == 1
    assert "Traceback" not in capfd.readouterr().err


def test_events_written_before_codecs_read_as_raw() -> None:
    event = {"event_id": "0" * 32, "request_id": "old", "shard": "shards/x.safetensors",
             "tensors": {"hidden_states": "old/hidden_states", "token_ids": "old/token_ids"}, "num_tokens": 3,
             "layer_ids": [1], "dtype": "bfloat16", "hidden_size": 8, "model": "m", "checksum": "crc32:00000001"}
    old = HiddenStatesReady.model_validate_json(orjson.dumps(event))
    assert (old.codec, old.shape) == (DatasetCodec.RAW, None)


def test_a_sample_fp8_cannot_hold_is_stored_raw() -> None:
    recs, _ = records("inf", tokens=3, per_block=3)
    (sample,) = feed(Assembler(), recs)
    assert isinstance(sample, Sample)
    values = np.frombuffer(sample.hidden_states, dtype=np.float32).copy()
    values[5] = np.inf  # E4M3FN has no infinities
    stored = encode(Sample(sample.manifest, values.tobytes(), sample.offsets), DatasetCodec.FP8)
    assert (stored.codec, stored.hidden_states) == (DatasetCodec.RAW, values.tobytes())
