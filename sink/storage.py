"""Where the dataset lives. One small interface so an object store can replace the
local directory later; the local implementation makes every write durable
(temp file, fsync, atomic rename, fsync of the directory) and never writes
outside its root."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path, PurePosixPath
from typing import Protocol


class Storage(Protocol):
    def write_atomic(self, relative: str, data: bytes) -> None:
        """Make ``data`` durable at ``relative``, replacing any previous content."""

    def read(self, relative: str) -> bytes: ...

    def list(self, prefix: str) -> list[str]:
        """Relative paths of the files directly under the folder ``prefix``, sorted."""

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
        path = self.local_path(relative)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as handle:
                handle.write(data)
                handle.flush()
                os.fsync(handle.fileno())
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        _fsync_dir(path.parent)

    def read(self, relative: str) -> bytes:
        return self.local_path(relative).read_bytes()

    def list(self, prefix: str) -> list[str]:
        folder = self.local_path(prefix)
        if not folder.is_dir():
            return []
        return sorted(f"{prefix}/{p.name}" for p in folder.iterdir() if p.is_file() and not p.name.startswith("."))

    def delete(self, relative: str) -> None:
        self.local_path(relative).unlink(missing_ok=True)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
