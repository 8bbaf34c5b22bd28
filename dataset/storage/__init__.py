"""Where a dataset lives: a local directory or an S3-compatible object store,
behind one small interface (:class:`Storage`) that the sink writes through and
the readers read through.

    storage = open_storage("out/")                 # LocalStorage
    storage = open_storage("s3://bucket/prefix")   # S3Storage (AWS_* environment)
"""

from __future__ import annotations

from pathlib import Path

from hsx.dataset.storage.base import (
    Storage, StorageRefused, StorageUnavailable, UnsafePath, UnsupportedLocation, Writer,
)
from hsx.dataset.storage.local import LocalStorage
from hsx.runtime.errors import UsageError

__all__ = ["LocalStorage", "Storage", "StorageRefused", "StorageUnavailable", "UnsafePath", "UnsupportedLocation",
           "Writer", "dataset_name", "is_object_store", "open_payload_store", "open_storage"]


def is_object_store(location: str | Path) -> bool:
    """Whether ``location`` names an object store (``s3://``) rather than a
    directory; raises :class:`UnsupportedLocation` for any other URL scheme."""
    text = str(location)
    if "://" in text and not text.startswith("s3://"):
        raise UnsupportedLocation(f"dataset {text}: {text.split('://', 1)[0]}:// is not supported "
                                  "(s3:// or a local path)")
    return text.startswith("s3://")


def open_storage(location: str | Path, *, create: bool = False, part_bytes: int | None = None) -> Storage:
    """The storage at ``location``: ``s3://bucket/prefix`` or a directory
    (created when ``create``; else it must exist). An object store is probed
    with one request, so that a wrong key or bucket fails here, in one line."""
    text = str(location)
    if is_object_store(text):
        from hsx.dataset.storage.s3 import DEFAULT_PART_BYTES, S3Storage  # obstore loads only for s3:// datasets

        storage = S3Storage(text, part_bytes or DEFAULT_PART_BYTES)
        storage.probe()
        return storage
    root = Path(location)
    if not create and not root.is_dir():
        raise FileNotFoundError(f"no dataset at {root}")
    return LocalStorage(root)


def open_payload_store(location: str) -> Storage:
    """The store ``--payload-store`` names, where hidden states are staged by
    reference: created when missing; a directory that cannot be is a
    :class:`~hsx.runtime.errors.UsageError` naming the flag. An object store's
    errors stay as :func:`open_storage` raises them (an unavailable one is not a
    usage error)."""
    if is_object_store(location):
        return open_storage(location)
    try:
        return open_storage(location, create=True)
    except OSError as exc:
        raise UsageError(f"--payload-store {location}: {exc}") from exc


def dataset_name(output: str) -> str:
    """The default dataset name: the output's last path part (a directory's
    resolved name, an object-store URL's last prefix part or its bucket)."""
    if is_object_store(output):
        return output.rstrip("/").rsplit("/", 1)[-1]
    return Path(output).resolve().name
