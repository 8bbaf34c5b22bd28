"""The streamed shard writer against safetensors' own reader, and the ranged
reader (:class:`RemoteShard`, here over a local directory's ranged reads)
against a whole-file read."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load

from hsx.dataset.safetensors_io import CorruptShard, RemoteShard, write_safetensors
from hsx.dataset.storage import LocalStorage


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return {
        "a/hidden_states": torch.randn(5, 3, 8, generator=g).to(torch.bfloat16),
        "a/token_ids": torch.arange(5, dtype=torch.int64),
        "a/loss_mask": torch.tensor([0, 1, 1, 0, 1], dtype=torch.bool),
        "b/hidden_states": torch.randint(0, 256, (37,), dtype=torch.uint8, generator=g),  # an odd-length codec payload
        "b/token_ids": torch.arange(3, dtype=torch.int64) + 100,
        "c/hidden_states": torch.randn(2, 1, 4, generator=g),
        "c/empty": torch.zeros(0, 4, dtype=torch.float16),
        "d/fp8": torch.randn(6, generator=g).to(torch.float8_e4m3fn),
    }


def _write(root: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> int:
    storage = LocalStorage(root)
    with storage.open_atomic("shards/x.safetensors") as out:
        return write_safetensors(out, tensors, metadata)


def test_safetensors_reads_what_the_streamed_writer_wrote(tmp_path: Path) -> None:
    tensors, metadata = _tensors(), {"model": "m", "codec": "raw"}
    size = _write(tmp_path, tensors, metadata)
    path = tmp_path / "shards" / "x.safetensors"
    assert path.stat().st_size == size
    with safe_open(str(path), framework="pt") as handle:
        assert handle.metadata() == metadata
        assert sorted(handle.keys()) == sorted(tensors)
        for name, tensor in tensors.items():
            got = handle.get_tensor(name)
            assert got.dtype == tensor.dtype and got.shape == tensor.shape
            assert torch.equal(got.view(torch.uint8), tensor.view(torch.uint8))
    assert sorted(load(path.read_bytes())) == sorted(tensors)  # the whole-buffer reader agrees


def test_every_tensor_starts_aligned_to_its_element_size(tmp_path: Path) -> None:
    _write(tmp_path, _tensors(), {})
    shard = RemoteShard(LocalStorage(tmp_path), "shards/x.safetensors")
    for name in shard.keys():
        dtype, _, begin, _ = shard._entries[name]
        assert (shard._base + begin) % dtype.itemsize == 0, name


def test_ranged_reads_return_what_a_whole_read_returns(tmp_path: Path) -> None:
    tensors = _tensors()
    _write(tmp_path, tensors, {"k": "v"})
    storage = LocalStorage(tmp_path)
    whole = load(storage.read("shards/x.safetensors"))
    shard = RemoteShard(storage, "shards/x.safetensors")
    assert shard.metadata() == {"k": "v"}
    shard.prefetch(["a/hidden_states", "a/token_ids", "c/empty"])
    for name in tensors:
        got = shard.get_tensor(name)
        assert got.dtype == whole[name].dtype and torch.equal(got.view(torch.uint8), whole[name].view(torch.uint8))
    got = shard.get_tensor("a/hidden_states")  # prefetched bytes are used once; a second read fetches again
    got.add_(1)  # a copy of its own
    assert torch.equal(shard.get_slice("a/hidden_states")[:, 1], whole["a/hidden_states"][:, 1])


def test_a_header_longer_than_the_first_read_is_completed(tmp_path: Path) -> None:
    tensors = {f"sample-{i:05d}/token_ids": torch.tensor([i], dtype=torch.int64) for i in range(4000)}
    _write(tmp_path, tensors, {})
    shard = RemoteShard(LocalStorage(tmp_path), "shards/x.safetensors")
    assert shard._base > 256 << 10 and len(shard.keys()) == 4000
    assert shard.get_tensor("sample-03999/token_ids").tolist() == [3999]


def test_a_truncated_or_foreign_shard_is_named(tmp_path: Path) -> None:
    _write(tmp_path, _tensors(), {})
    path = tmp_path / "shards" / "x.safetensors"
    path.write_bytes(path.read_bytes()[:-10])
    shard = RemoteShard(LocalStorage(tmp_path), "shards/x.safetensors")
    with pytest.raises(CorruptShard, match=r"shards/x.safetensors: d/fp8 has 0 of its 6 bytes|shorter than its header"):
        shard.get_tensor("d/fp8")
    path.write_bytes(b"\x05\x00\x00\x00\x00\x00\x00\x00{oops")
    with pytest.raises(CorruptShard, match=r"shards/x.safetensors: not a safetensors header"):
        RemoteShard(LocalStorage(tmp_path), "shards/x.safetensors")
    with pytest.raises(KeyError, match="holds no tensor 'nope'"):
        _write(tmp_path, _tensors(), {})
        RemoteShard(LocalStorage(tmp_path), "shards/x.safetensors").get_tensor("nope")


def test_a_failed_write_leaves_no_object(tmp_path: Path) -> None:
    storage = LocalStorage(tmp_path)
    with pytest.raises(RuntimeError), storage.open_atomic("shards/y.safetensors") as out:
        out.write(b"half")
        raise RuntimeError("disk gone")
    assert storage.list("shards") == [] and not any((tmp_path / "shards").iterdir())
