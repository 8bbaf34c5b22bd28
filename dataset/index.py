"""Reading a dataset's shard indexes (``index/<shard>.json``, each a
:class:`~hsx.schemas.ShardIndex`: what makes a shard part of the dataset) and
the samples they name, with the errors that say which file is damaged."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from functools import lru_cache
from typing import Any

from pydantic import ValidationError

from hsx.dataset.encoding import read_token_ids
from hsx.dataset.shard_reader import open_shard
from hsx.dataset.shards import INDEX
from hsx.dataset.storage import Storage
from hsx.runtime.errors import HsxError
from hsx.schemas import HiddenStatesReady, ShardIndex, format_validation_error


class CorruptIndex(HsxError, ValueError):
    """An index file that is not a shard index (damaged, or changed by hand); the
    message names it and what is wrong."""


def read_index(storage: Storage, path: str) -> ShardIndex:
    """The shard index at ``path``; :class:`CorruptIndex` when it is not one."""
    return parse_index(storage, path, storage.read(path))


def parse_index(storage: Storage, path: str, data: bytes) -> ShardIndex:
    """The shard index read from ``path``; :class:`CorruptIndex` when it is not one."""
    try:
        return ShardIndex.model_validate_json(data)
    except ValidationError as exc:
        raise CorruptIndex(f"{storage.url}/{path} is not a shard index ({format_validation_error(exc, limit=3)}): "
                           "restore it; the dataset was damaged or changed by hand") from None


def read_indexes(storage: Storage, prefix: str = "") -> list[ShardIndex]:
    """Every shard index (optionally only those whose name starts with ``prefix``),
    in name order; read 16 at a time, as each is a round trip on an object store.
    :class:`CorruptIndex` names the first that is not one."""
    paths = [path for path in storage.list(INDEX, starting=prefix) if path.endswith(".json")]
    with ThreadPoolExecutor(16) as pool:
        return [parse_index(storage, path, data) for path, data in zip(paths, pool.map(storage.read, paths))]


class MissingShard(HsxError, FileNotFoundError):
    """A ready event names a shard the dataset does not hold."""


def stored_token_ids(storage: Storage, event: HiddenStatesReady) -> list[int]:
    """The token ids of a sample already in the dataset (read once per shard, to
    build a key file the shard does not have yet); :class:`MissingShard` when
    the shard its index entry names is not there."""
    try:
        shard = _open_shard(storage, event.shard)
    except FileNotFoundError:
        raise MissingShard(f"{storage.url}/{event.shard}, named by the index of sample {event.request_id}, is "
                           "missing: restore it; the dataset was damaged or changed by hand") from None
    return read_token_ids(shard, event).tolist()


@lru_cache(maxsize=4)
def _open_shard(storage: Storage, relative: str) -> Any:
    # Building a key file reads every sample of one shard: keeping the last few
    # open spares re-reading a large header per sample.
    return open_shard(storage, relative)
