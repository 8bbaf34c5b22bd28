"""Where the dataset lives. One small interface so an object store can replace the
local directory later; the local implementation makes every write durable
(temp file, fsync, atomic rename, fsync of the directory) and never writes
outside its root."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path, PurePosixPath
from typing import Protocol


class Storage(Protocol):
    def write_atomic(self, relative: str, data: bytes) -> None:
        """Make ``data`` durable at ``relative``, replacing any previous content."""

    def write_atomic_with(self, relative: str, write: Callable[[Path], None]) -> None:
        """Like :meth:`write_atomic`, for content that ``write`` puts into the
        (temporary) local file it is given: large files never sit whole in memory."""

    def read(self, relative: str) -> bytes: ...

    def list(self, prefix: str, starting: str = "", after: str = "") -> list[str]:
        """Relative paths of the files directly under the folder ``prefix``, sorted;
        only those whose name starts with ``starting`` and sorts after ``after``.

        Both filters are what an object store's listing takes (``Prefix``,
        ``StartAfter``, paginated): one partition's files, or only those past its
        last indexed shard, cost requests for those alone, not for the dataset."""

    def delete(self, relative: str) -> None: ...

    def local_path(self, relative: str) -> Path:
        """A path the reader can memory-map."""


class UnsafePath(ValueError):
    """A relative path that would leave the dataset root."""


class LocalStorage:
    """A dataset in a local (or mounted) directory."""

    def __init__(self, root: Path) -> None:
        self.root = root.resolve()
        self.root.mkdir(parents=True, exist_ok=True)

    def local_path(self, relative: str) -> Path:
        parts = PurePosixPath(relative).parts
        if not parts or PurePosixPath(relative).is_absolute() or ".." in parts:
            raise UnsafePath(f"{relative!r} is not a relative path inside the dataset")
        path = self.root.joinpath(*parts)
        if not path.resolve().is_relative_to(self.root):  # e.g. through a symlink
            raise UnsafePath(f"{relative!r} resolves outside the dataset root")
        return path

    def write_atomic(self, relative: str, data: bytes) -> None:
        self.write_atomic_with(relative, lambda tmp: tmp.write_bytes(data))

    def write_atomic_with(self, relative: str, write: Callable[[Path], None]) -> None:
        path = self.local_path(relative)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        os.close(fd)
        tmp = Path(name)
        try:
            write(tmp)
            _fsync(tmp)
            os.replace(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        _fsync(path.parent)

    def read(self, relative: str) -> bytes:
        return self.local_path(relative).read_bytes()

    def list(self, prefix: str, starting: str = "", after: str = "") -> list[str]:
        folder = self.local_path(prefix)
        if not folder.is_dir():
            return []
        with os.scandir(folder) as entries:  # scandir: no stat per entry, for folders of many shards
            names = [e.name for e in entries
                     if e.name.startswith(starting) and e.name > after and not e.name.startswith(".") and e.is_file()]
        return [f"{prefix}/{name}" for name in sorted(names)]

    def delete(self, relative: str) -> None:
        self.local_path(relative).unlink(missing_ok=True)


def _fsync(path: Path) -> None:
    """Flush a file or a folder (its entries) to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
