"""A dataset in a local (or mounted) directory: every write durable (temp file,
fsync, atomic rename, fsync of the directory), nothing written outside the root."""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from hsx.dataset.storage.base import UnsafePath, Writer, checked_parts
from hsx.dataset.storage.direct_file import direct_writer


class LocalStorage:
    def __init__(self, root: Path) -> None:
        self.root = root.resolve()
        self.root.mkdir(parents=True, exist_ok=True)
        self.url = str(root)

    def local_path(self, relative: str) -> Path:
        path = self.root.joinpath(*checked_parts(relative))
        if not path.resolve().is_relative_to(self.root):  # e.g. through a symlink
            raise UnsafePath(f"{relative!r} resolves outside the dataset root")
        return path

    def write_atomic(self, relative: str, data: bytes) -> None:
        with self.open_atomic(relative) as out:
            out.write(data)

    @contextmanager
    def open_atomic(self, relative: str, cache: bool = True) -> Iterator[Writer]:
        """1. write a temp file beside the target (around the page cache unless
        ``cache``: :mod:`~hsx.dataset.storage.direct_file`); 2. fsync it; 3. rename
        it over the target; 4. fsync the folder, so the rename survives a power cut."""
        path = self.local_path(relative)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        tmp = Path(name)
        try:
            with os.fdopen(fd, "wb") as out:
                if cache:
                    yield out
                    out.flush()
                else:
                    with direct_writer(fd) as direct:
                        yield direct
                os.fsync(fd)
            os.replace(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        fsync_path(path.parent)

    def read(self, relative: str) -> bytes:
        return self.local_path(relative).read_bytes()

    def read_ranges(self, relative: str, ranges: Sequence[tuple[int, int]]) -> list[memoryview]:
        with self.local_path(relative).open("rb") as stream:
            size = os.fstat(stream.fileno()).st_size  # read(n) allocates n bytes first: cut the range at the end
            out = []
            for start, end in ranges:
                stream.seek(start)
                out.append(memoryview(stream.read(max(0, min(end, size) - start))))
            return out

    def list(self, prefix: str, starting: str = "", after: str = "") -> list[str]:
        folder = self.local_path(prefix)
        if not folder.is_dir():
            return []
        with os.scandir(folder) as entries:  # scandir: no stat per entry, for folders of many shards
            names = [e.name for e in entries
                     if e.name.startswith(starting) and e.name > after and not e.name.startswith(".") and e.is_file()]
        return [f"{prefix}/{name}" for name in sorted(names)]

    def stale(self, suffix: str, older_than: float) -> list[str]:
        cutoff = time.time() - older_than
        with os.scandir(self.root) as entries:
            return sorted(e.name for e in entries if e.is_file() and e.stat().st_mtime < cutoff and (
                e.name.endswith(suffix) or (e.name.startswith(".") and e.name.endswith(".tmp") and f"{suffix}." in e.name)))

    def size(self, relative: str) -> int:
        return self.local_path(relative).stat().st_size

    def delete(self, relative: str) -> None:
        self.local_path(relative).unlink(missing_ok=True)

    def delete_many(self, paths: Sequence[str]) -> None:
        for relative in paths:
            self.delete(relative)


def fsync_path(path: Path) -> None:
    """Flush a file or a folder (its entries) to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
