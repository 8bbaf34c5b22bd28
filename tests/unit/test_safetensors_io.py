"""The streamed shard writer against safetensors' own reader, and the ranged
reader (:class:`RemoteShard`, here over a local directory's ranged reads)
against a whole-file read; a damaged header is refused by both readers alike,
before anything is sized from it."""

from __future__ import annotations

import io
import struct
from pathlib import Path

import orjson
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load

from hsx.dataset.safetensors_io import write_safetensors
from hsx.dataset.shard_reader import CorruptShard, RemoteShard, open_shard
from hsx.dataset.sample import FileRange, Pieces
from hsx.dataset.storage import LocalStorage
from hsx.runtime.errors import HsxError


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
    with pytest.raises(CorruptShard, match="holds no tensor 'nope'"):
        _write(tmp_path, _tensors(), {})
        RemoteShard(LocalStorage(tmp_path), "shards/x.safetensors").get_tensor("nope")


def test_a_failed_write_leaves_no_object(tmp_path: Path) -> None:
    storage = LocalStorage(tmp_path)
    with pytest.raises(RuntimeError), storage.open_atomic("shards/y.safetensors") as out:
        out.write(b"half")
        raise RuntimeError("disk gone")
    assert storage.list("shards") == [] and not any((tmp_path / "shards").iterdir())


def _raw_shard(root: Path, header: bytes, body: bytes = bytes(16)) -> LocalStorage:
    """A file at shards/x.safetensors: ``header`` as it stands, then ``body``."""
    storage = LocalStorage(root)
    (root / "shards").mkdir(exist_ok=True)
    (root / "shards" / "x.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + body)
    return storage


@pytest.mark.parametrize("entry, problem", [
    ({"dtype": "F32", "shape": [2**40, 2**40], "data_offsets": [0, 16]}, r"takes \d+ bytes, its offsets \[0, 16\) say 16"),
    ({"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 8, 16]}, "not a safetensors tensor entry"),
    ({"dtype": "F32", "shape": [True, 4], "data_offsets": [0, 16]}, "not non-negative 64-bit integers"),
    ({"dtype": "F32", "shape": [4], "data_offsets": [-16, 0]}, "not non-negative 64-bit integers"),
    ({"dtype": "C64", "shape": [2], "data_offsets": [0, 16]}, "not a safetensors tensor entry"),
])
def test_a_remote_header_is_checked_before_a_tensor_is_sized_from_it(tmp_path: Path, entry: dict, problem: str) -> None:
    """As safetensors checks a header: a shape the offsets do not hold exactly,
    or anything but a known dtype, non-negative integers and two offsets."""
    storage = _raw_shard(tmp_path, orjson.dumps({"t": entry}))
    with pytest.raises(CorruptShard, match=problem):
        RemoteShard(storage, "shards/x.safetensors")


@pytest.mark.parametrize("header, declared, problem", [
    (b'"abc"', None, "not a safetensors header .a JSON str"),
    (b'{"__metadata__": {"k": 1}}', None, "__metadata__ is not a map of strings"),
    (b"{}", 2**64 - 1, "more than safetensors reads"),
    (b"{}", 4096, "a header of 4096 bytes declared, 18 present"),
])
def test_a_remote_header_that_is_no_header_is_named(tmp_path: Path, header: bytes, declared: int | None,
                                                     problem: str) -> None:
    storage = _raw_shard(tmp_path, header)
    if declared is not None:
        path = tmp_path / "shards" / "x.safetensors"
        path.write_bytes(struct.pack("<Q", declared) + path.read_bytes()[8:])
    with pytest.raises(CorruptShard, match=problem):
        RemoteShard(storage, "shards/x.safetensors")


def test_both_kinds_of_shard_describe_tensors_and_refuse_alike(tmp_path: Path) -> None:
    """Memory-mapped or ranged, a shard tells a tensor's dtype and shape from its
    header, and one that is not safetensors, or lacks a tensor asked for, is a
    CorruptShard naming it (an HsxError: one line from the CLI)."""
    tensors = _tensors()
    _write(tmp_path, tensors, {})
    storage = LocalStorage(tmp_path)
    for shard in (open_shard(storage, "shards/x.safetensors"), RemoteShard(storage, "shards/x.safetensors")):
        assert shard.describe("a/hidden_states") == ("BF16", (5, 3, 8))
        assert shard.describe("c/empty") == ("F16", (0, 4))
        with pytest.raises(CorruptShard, match="shards/x.safetensors.*nope"):
            shard.get_tensor("nope")
    (tmp_path / "shards" / "x.safetensors").write_bytes(b"\x05\x00\x00\x00\x00\x00\x00\x00{oops")
    with pytest.raises(CorruptShard, match="shards/x.safetensors: not a safetensors file") as refused:
        open_shard(storage, "shards/x.safetensors")
    assert isinstance(refused.value, HsxError)


class _NotAFile(io.BytesIO):
    """A writer without a file descriptor, as an object store's is."""

    def fileno(self) -> int:
        raise io.UnsupportedOperation("fileno")


@pytest.mark.parametrize("into", ["file", "not a file"])
def test_file_ranges_and_pieces_are_written_as_uint8_tensors(tmp_path: Path, into: str) -> None:
    """A :class:`FileRange` is written as the 1-D uint8 tensor of its bytes: into
    a file by the kernel's copy, into anything else by reads and writes; so are
    :class:`Pieces`, one after another; the tensors around them land where the
    header says."""
    source = tmp_path / "staged.bin"
    source.write_bytes(bytes(range(256)) * 40)
    tensors: dict[str, torch.Tensor | FileRange] = {
        "f/hidden_states": FileRange(source, 100, 5_000), **_tensors(), "z/hidden_states": FileRange(source, 0, 3),
        "p/hidden_states": Pieces.of([b"abc", memoryview(b"defg"), b""])}
    if into == "file":
        _write(tmp_path / "out", tensors, {"codec": "byteplane-zstd"})
        data = (tmp_path / "out" / "shards" / "x.safetensors").read_bytes()
    else:
        out = _NotAFile()
        write_safetensors(out, tensors, {"codec": "byteplane-zstd"})
        data = out.getvalue()
    loaded = load(data)
    assert loaded["f/hidden_states"].dtype == torch.uint8
    assert loaded["f/hidden_states"].numpy().tobytes() == source.read_bytes()[100:5_100]
    assert loaded["z/hidden_states"].numpy().tobytes() == b"\x00\x01\x02"
    assert loaded["p/hidden_states"].numpy().tobytes() == b"abcdefg"
    for name, tensor in _tensors().items():
        assert loaded[name].dtype == tensor.dtype and loaded[name].shape == tensor.shape, name
        assert loaded[name].view(torch.uint8).numpy().tobytes() == tensor.view(torch.uint8).numpy().tobytes(), name


def test_a_file_range_past_its_file_end_fails_the_write(tmp_path: Path) -> None:
    source = tmp_path / "staged.bin"
    source.write_bytes(b"x" * 10)
    with pytest.raises(OSError, match="holds 6 of the 8 bytes from offset 4"):
        _write(tmp_path / "out", {"a": FileRange(source, 4, 8)}, {})
    assert not (tmp_path / "out" / "shards" / "x.safetensors").exists()
