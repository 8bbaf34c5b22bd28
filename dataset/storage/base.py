"""What every place a dataset can live offers the sink and the readers, and the
two ways it can fail.

A dataset is a flat set of named objects (``shards/…``, ``index/…``, ``keys/…``,
``topics/…``, see :mod:`hsx.dataset.shards`). Each write is whole or absent: a reader
never sees half an object, on a local disk (temp file, fsync, rename) or in an
object store (one PUT, or a multipart upload completed at the end).
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager
from pathlib import Path, PurePosixPath
from typing import Protocol

from hsx.runtime.errors import ServiceFailed, UsageError


class Writer(Protocol):
    def write(self, data: bytes | memoryview, /) -> int: ...


class Storage(Protocol):
    url: str
    """Where the dataset is, for messages (a directory or ``s3://bucket/prefix``)."""

    def write_atomic(self, relative: str, data: bytes) -> None:
        """Make ``data`` durable at ``relative``, replacing any previous content."""

    def open_atomic(self, relative: str, cache: bool = True) -> AbstractContextManager[Writer]:
        """A writer for a large object, streamed: memory holds a buffer, never the
        object. The object appears (replacing any previous one) when the block
        exits normally, and not at all when it raises. ``cache=False``: this
        machine will not read it back soon (a shard), so a file is written
        around the page cache."""

    def read(self, relative: str) -> bytes:
        """The whole object; :class:`FileNotFoundError` when there is none."""

    def read_ranges(self, relative: str, ranges: Sequence[tuple[int, int]]) -> list[memoryview]:
        """The bytes ``[start, end)`` of each range (requests for nearby ranges
        coalesced, the rest in parallel on an object store). A range past the
        object's end is cut at the end."""

    def list(self, prefix: str, starting: str = "", after: str = "") -> list[str]:
        """Relative paths of the objects directly under the folder ``prefix``, sorted;
        only those whose name starts with ``starting`` and sorts after ``after``.

        Both filters are what an object store's listing takes (``Prefix``,
        ``StartAfter``, paginated): one partition's files, or only those past its
        last indexed shard, cost requests for those alone, not for the dataset."""

    def stale(self, suffix: str, older_than: float) -> list[str]:
        """Relative paths of the objects at the top of the store whose name ends
        with ``suffix``, last modified more than ``older_than`` seconds ago (on a
        file system, the temp files of writes a kill interrupted included)."""

    def delete(self, relative: str) -> None:
        """Remove the object if it is there."""

    def delete_many(self, paths: Sequence[str]) -> None:
        """Remove these objects where they are (on S3 in bulk: a request per 1,000)."""

    def size(self, relative: str) -> int:
        """The object's size in bytes; :class:`FileNotFoundError` when there is none."""

    def local_path(self, relative: str) -> Path | None:
        """A path the reader can memory-map, or None where the dataset is not on
        a file system (read it with :meth:`read_ranges`)."""


class UnsupportedLocation(UsageError, ValueError):
    """A dataset location no storage serves (an unknown URL scheme, an s3:// URL without a bucket)."""


class UnsafePath(ValueError):
    """A relative path that would leave the dataset root."""


class StorageRefused(ServiceFailed):
    """The storage answered, and will keep answering, no: access denied, no such
    bucket. Retrying cannot help; the message says what to check."""


class StorageUnavailable(OSError):
    """The storage did not answer in time or failed on its side (5xx, throttling),
    after the client's own retries. Writers keep what they hold, commit nothing
    and try again later (an ``OSError``, as a full disk is)."""


def checked_parts(relative: str) -> tuple[str, ...]:
    """The path's parts, refusing one that is absolute or climbs out with ``..``."""
    path = PurePosixPath(relative)
    if not path.parts or path.is_absolute() or ".." in path.parts:
        raise UnsafePath(f"{relative!r} is not a relative path inside the dataset")
    return path.parts
