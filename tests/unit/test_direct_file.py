"""Shards written around the page cache (hsx.dataset.storage.direct_file): the
same bytes as a buffered write, whatever the sizes written, and none of them
left in the page cache."""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import random
from pathlib import Path

import pytest

from hsx.dataset.file_copy import copy_range
from hsx.dataset.sample import FileRange
from hsx.dataset.storage import LocalStorage
from hsx.dataset.storage import direct_file
from hsx.dataset.storage.direct_file import ALIGN, CHUNK

SIZES = {
    "empty": [],
    "one byte": [1],
    "one block": [ALIGN],
    "one chunk": [CHUNK],
    "a chunk and a byte": [CHUNK, 1],
    "unaligned pieces across chunks": [100, CHUNK - 50, 7, 2 * CHUNK + 3],
}


def _written(storage: LocalStorage, sizes: list[int], source: Path | None = None) -> bytes:
    """Write pieces of these sizes (and, from ``source``, a range of it) around
    the page cache; the bytes written, in order."""
    rng = random.Random(len(sizes))
    expected = bytearray()
    with storage.open_atomic("shards/s.safetensors", cache=False) as out:
        for size in sizes:
            piece = rng.randbytes(size)
            assert out.write(piece) == size
            expected += piece
        if source is not None:
            data = source.read_bytes()
            copy_range(FileRange(source, 3, len(data) - 5), out)
            expected += data[3:-2]
    return bytes(expected)


@pytest.mark.parametrize("sizes", SIZES.values(), ids=SIZES.keys())
def test_the_file_holds_exactly_what_was_written(tmp_path: Path, sizes: list[int]) -> None:
    storage = LocalStorage(tmp_path)
    expected = _written(storage, sizes)
    assert (tmp_path / "shards" / "s.safetensors").read_bytes() == expected
    assert [p.name for p in (tmp_path / "shards").iterdir()] == ["s.safetensors"]  # no temp file left


def test_a_staged_file_is_read_straight_into_the_buffer(tmp_path: Path) -> None:
    source = tmp_path / "staged.bin"
    source.write_bytes(random.Random(0).randbytes(CHUNK + 12_345))
    storage = LocalStorage(tmp_path / "dataset")
    expected = _written(storage, [5], source)
    assert (tmp_path / "dataset" / "shards" / "s.safetensors").read_bytes() == expected


def test_a_staged_file_shorter_than_verified_fails_the_write(tmp_path: Path) -> None:
    source = tmp_path / "staged.bin"
    source.write_bytes(b"x" * 100)
    storage = LocalStorage(tmp_path / "dataset")
    with pytest.raises(OSError, match="holds 97 of the 200 bytes"):
        with storage.open_atomic("shards/s.safetensors", cache=False) as out:
            copy_range(FileRange(source, 3, 200), out)
    assert not list((tmp_path / "dataset" / "shards").iterdir())  # the shard is absent, not short


def _resident_pages(path: Path) -> int:
    """Pages of ``path`` in the page cache (mincore of a mapping of it)."""
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    size = path.stat().st_size
    pages = -(-size // mmap.PAGESIZE)
    with path.open("rb") as f, mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY) as mapped:
        address = ctypes.addressof(ctypes.c_char.from_buffer(mapped))
        vector = ctypes.create_string_buffer(pages)
        assert libc.mincore(address, size, vector) == 0, os.strerror(ctypes.get_errno())
        resident = sum(byte & 1 for byte in vector.raw)
    return resident


def test_a_shard_leaves_no_page_in_the_page_cache(tmp_path: Path) -> None:
    """The point of it: a buffered write (the control) leaves the file's pages
    cached, each one a page the kernel had to find; the direct one none."""
    storage = LocalStorage(tmp_path)
    piece = random.Random(1).randbytes(CHUNK)
    with storage.open_atomic("shards/cached.safetensors") as out:
        for _ in range(4):
            out.write(piece)
    with storage.open_atomic("shards/direct.safetensors", cache=False) as out:
        for _ in range(4):
            out.write(piece)
    assert _resident_pages(tmp_path / "shards" / "cached.safetensors") > 0
    assert _resident_pages(tmp_path / "shards" / "direct.safetensors") == 0


def test_a_file_system_that_refuses_direct_writes_gets_the_same_bytes(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Some file systems accept O_DIRECT at open and refuse the write (EINVAL):
    the writer goes on through the page cache."""
    real_pwrite = os.pwrite
    refused = []

    def pwrite(fd: int, data: memoryview, offset: int) -> int:
        import fcntl

        if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
            refused.append(offset)
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_pwrite(fd, data, offset)

    monkeypatch.setattr(direct_file.os, "pwrite", pwrite)
    storage = LocalStorage(tmp_path)
    expected = _written(storage, SIZES["unaligned pieces across chunks"])
    assert refused == [0]  # refused once, then written without O_DIRECT
    assert (tmp_path / "shards" / "s.safetensors").read_bytes() == expected


def test_a_file_system_that_refuses_direct_io_at_open_gets_the_same_bytes(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """Others refuse O_DIRECT on the descriptor itself (EINVAL from fcntl): the
    file is written through the page cache from the start."""
    import fcntl

    real_fcntl = fcntl.fcntl
    refused = []

    def refusing(fd: int, command: int, argument: int = 0) -> int:
        if command == fcntl.F_SETFL and argument & os.O_DIRECT:
            refused.append(fd)
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_fcntl(fd, command, argument)

    monkeypatch.setattr(direct_file.fcntl, "fcntl", refusing)
    storage = LocalStorage(tmp_path)
    expected = _written(storage, SIZES["a chunk and a byte"])
    assert len(refused) == 1
    assert (tmp_path / "shards" / "s.safetensors").read_bytes() == expected


def _staged(tmp_path: Path, size: int) -> tuple[Path, bytes]:
    """A staged object as the connector writes one: around the page cache."""
    data = random.Random(size).randbytes(size)
    with LocalStorage(tmp_path / "staging").open_atomic("r.blocks", cache=False) as out:
        out.write(data)
    path = tmp_path / "staging" / "r.blocks"
    assert _resident_pages(path) == 0
    return path, data


@pytest.mark.parametrize("size", [1, ALIGN, CHUNK + 12_345, 2 * CHUNK])
def test_a_staged_object_is_copied_into_a_shard_around_the_page_cache(tmp_path: Path, size: int) -> None:
    """From offset 0 (a whole staged object) through a second aligned buffer,
    into a shard whose buffer is 5 bytes in (unaligned): the same bytes, and
    not one page of the staged object cached on the way."""
    source, data = _staged(tmp_path, size)
    storage = LocalStorage(tmp_path / "dataset")
    with storage.open_atomic("shards/s.safetensors", cache=False) as out:
        out.write(b"head!")
        copy_range(FileRange(source, 0, size), out)
    assert (tmp_path / "dataset" / "shards" / "s.safetensors").read_bytes() == b"head!" + data
    assert _resident_pages(source) == 0


def test_a_staged_object_shorter_than_verified_fails_the_write_around_the_cache(tmp_path: Path) -> None:
    source, _ = _staged(tmp_path, 100)
    with pytest.raises(OSError, match="holds 100 of the 200 bytes"):
        with LocalStorage(tmp_path / "dataset").open_atomic("shards/s.safetensors", cache=False) as out:
            copy_range(FileRange(source, 0, 200), out)


@pytest.mark.parametrize("refuse", [False, True], ids=["direct", "refused at the read"])
def test_a_staged_object_is_read_whole_into_an_aligned_buffer(tmp_path: Path, refuse: bool,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """What the sink verifies a staged object from; a file system that accepts
    O_DIRECT at open and refuses the read (EINVAL) is read through the cache."""
    source, data = _staged(tmp_path, CHUNK + 7)
    real_preadv = os.preadv
    refused = []

    def preadv(fd: int, buffers: list[memoryview], offset: int) -> int:
        import fcntl

        if refuse and fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
            refused.append(offset)
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_preadv(fd, buffers, offset)

    monkeypatch.setattr(direct_file.os, "preadv", preadv)
    buffer = mmap.mmap(-1, 2 * CHUNK)
    with direct_file.open_uncached(source) as fd:
        got = direct_file.read_aligned(fd, memoryview(buffer)[:CHUNK + ALIGN], 0)
    assert (got, buffer[:got]) == (len(data), data)
    assert refused == ([0] if refuse else [])
    assert (_resident_pages(source) > 0) == refuse
