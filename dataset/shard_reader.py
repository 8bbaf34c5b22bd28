"""Reading shards: :func:`open_shard` gives a :class:`LocalShard` (memory-mapped by
safetensors' own ``safe_open``) or, since ``safe_open`` maps only local files, a
:class:`RemoteShard` that reads the header once and then each tensor with a
ranged read (the format: :mod:`hsx.dataset.safetensors_io`).

Both check a shard's header before anything is sized from it, and raise
:class:`CorruptShard` for a shard that is not what its header or its index says.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import orjson
from safetensors import SafetensorError, safe_open

from hsx.dataset.safetensors_io import safetensors_dtype, torch_dtypes
from hsx.dataset.storage import Storage
from hsx.runtime.errors import HsxError

if TYPE_CHECKING:  # torch is imported where tensors are made: `hsx.open_dataset` imports without it
    import torch


_HEADER_GUESS = 256 << 10
"""The first read of a remote shard: the header of a shard of ~2,000 samples."""
MAX_HEADER_BYTES = 100_000_000
"""The longest header safetensors itself reads (its ``MAX_HEADER_SIZE``): a longer
declared length is damage, not a header to fetch."""


def open_shard(storage: Storage, relative: str) -> LocalShard | RemoteShard:
    """An open shard (``keys``, ``metadata``, ``describe``, ``get_tensor``,
    ``get_slice``): a :class:`LocalShard` where the dataset is on a file system,
    else a :class:`RemoteShard`. :class:`FileNotFoundError` when absent,
    :class:`CorruptShard` when it is not a safetensors file, either way."""
    path = storage.local_path(relative)
    if path is None:
        return RemoteShard(storage, relative)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such shard")
    return LocalShard(path, relative)


def prefetch(shard: Any, names: Iterable[str]) -> None:
    """Read these tensors of a remote shard in one go (in parallel, nearby ones
    coalesced); a no-op for a memory-mapped one, whose pages come on demand."""
    if isinstance(shard, RemoteShard):
        shard.prefetch(names)


class CorruptShard(HsxError, ValueError):
    """A shard whose header or bytes are not what safetensors says they must be,
    or that lacks a tensor its index names; the message names the shard."""


class LocalShard:
    """A shard on a file system, memory-mapped by safetensors' ``safe_open``, which
    checks the whole header against the file's size on opening."""

    def __init__(self, path: Path, relative: str) -> None:
        self._relative = relative
        try:
            self._handle = safe_open(str(path), framework="pt")
        except SafetensorError as exc:
            raise CorruptShard(f"shard {relative}: not a safetensors file ({exc})") from exc

    def keys(self) -> list[str]:
        return self._handle.keys()  # type: ignore[no-any-return]

    def metadata(self) -> dict[str, str] | None:
        return self._handle.metadata()  # type: ignore[no-any-return]

    def describe(self, name: str) -> tuple[str, tuple[int, ...]]:
        """The tensor's safetensors dtype name and shape, from the header alone."""
        view = self.get_slice(name)
        return view.get_dtype(), tuple(view.get_shape())

    def get_tensor(self, name: str) -> torch.Tensor:
        try:
            return self._handle.get_tensor(name)
        except SafetensorError as exc:  # a tensor the shard does not hold
            raise CorruptShard(f"shard {self._relative}: {exc}") from exc

    def get_slice(self, name: str) -> Any:
        """safe_open's slice: indexing it reads only the rows selected."""
        try:
            return self._handle.get_slice(name)
        except SafetensorError as exc:
            raise CorruptShard(f"shard {self._relative}: {exc}") from exc


class RemoteShard:
    """A shard in an object store: its header read once (one ranged read for
    most shards), then only the bytes of the tensors asked for."""

    def __init__(self, storage: Storage, relative: str) -> None:
        self._storage, self._relative = storage, relative
        first = storage.read_ranges(relative, [(0, _HEADER_GUESS)])[0]
        if len(first) < 8:
            raise CorruptShard(f"shard {relative}: {len(first)} bytes, too short for a safetensors header")
        (length,) = struct.unpack_from("<Q", first)
        if length > MAX_HEADER_BYTES:
            raise CorruptShard(f"shard {relative}: a header of {length} bytes declared, more than safetensors "
                               f"reads ({MAX_HEADER_BYTES})")
        raw = bytes(first[8:8 + length])
        if len(raw) < length:
            raw += bytes(storage.read_ranges(relative, [(len(first), 8 + length)])[0])
        if len(raw) < length:
            raise CorruptShard(f"shard {relative}: a header of {length} bytes declared, {len(raw)} present")
        try:
            header = orjson.loads(raw)
        except orjson.JSONDecodeError as exc:
            raise CorruptShard(f"shard {relative}: not a safetensors header ({exc})") from exc
        if not isinstance(header, dict):
            raise CorruptShard(f"shard {relative}: not a safetensors header (a JSON {type(header).__name__})")
        metadata = header.pop("__metadata__", None)
        if metadata is not None and not (isinstance(metadata, dict)
                                         and all(isinstance(v, str) for v in metadata.values())):
            raise CorruptShard(f"shard {relative}: __metadata__ is not a map of strings")
        self._metadata: dict[str, str] | None = metadata
        self._entries = {name: _entry(relative, name, e) for name, e in header.items()}
        self._base = 8 + length
        self._fetched: dict[str, memoryview] = {}

    def keys(self) -> list[str]:
        return list(self._entries)

    def metadata(self) -> dict[str, str] | None:
        return self._metadata

    def nbytes(self, name: str) -> int:
        begin, end = self._range(name)
        return end - begin

    def describe(self, name: str) -> tuple[str, tuple[int, ...]]:
        """The tensor's safetensors dtype name and shape, from the header alone."""
        self._range(name)
        dtype, shape, _, _ = self._entries[name]
        return safetensors_dtype(dtype), shape

    def prefetch(self, names: Iterable[str]) -> None:
        wanted = [name for name in names if name not in self._fetched]
        parts = self._storage.read_ranges(self._relative, [self._range(name) for name in wanted])
        self._fetched.update(zip(wanted, parts))

    def get_tensor(self, name: str) -> torch.Tensor:
        """The tensor, a copy of its own; prefetched bytes are used once."""
        import torch

        data = self._fetched.pop(name, None)
        if data is None:
            data = self._storage.read_ranges(self._relative, [self._range(name)])[0]
        dtype, shape, begin, end = self._entries[name]
        if len(data) != end - begin:
            raise CorruptShard(f"shard {self._relative}: {name} has {len(data)} of its {end - begin} bytes "
                               "(the object is shorter than its header says)")
        if not data:
            return torch.empty(shape, dtype=dtype)
        return torch.frombuffer(bytearray(data), dtype=dtype).view(shape)

    def get_slice(self, name: str) -> torch.Tensor:
        """The whole tensor: indexing it selects as safe_open's slice does."""
        return self.get_tensor(name)

    def _range(self, name: str) -> tuple[int, int]:
        if name not in self._entries:
            raise CorruptShard(f"shard {self._relative} holds no tensor {name!r}")
        _, _, begin, end = self._entries[name]
        return self._base + begin, self._base + end


def _entry(relative: str, name: str, entry: Any) -> tuple[torch.dtype, tuple[int, ...], int, int]:
    """``(dtype, shape, begin, end)`` of one tensor of a header, checked as
    safetensors checks it: a known dtype, and offsets that hold exactly the
    shape's bytes, so that nothing is sized from a shape the bytes do not back."""
    try:
        dtype, shape, (begin, end) = torch_dtypes()[entry["dtype"]], entry["shape"], entry["data_offsets"]
    except (KeyError, TypeError, ValueError) as exc:
        raise CorruptShard(f"shard {relative}: {name!r} is not a safetensors tensor entry ({exc!r})") from None
    integers = [*shape, begin, end] if isinstance(shape, list) else None
    if integers is None or not all(type(n) is int and 0 <= n < 1 << 63 for n in integers):
        raise CorruptShard(f"shard {relative}: {name!r} has shape {shape!r} and offsets {[begin, end]!r}, "
                           "not non-negative 64-bit integers")
    size = 0 if 0 in shape else dtype.itemsize
    for n in shape:
        if size > end - begin:  # the product only grows from here: stop before it is a huge integer
            break
        size *= n
    if end - begin != size:
        raise CorruptShard(f"shard {relative}: {name!r} of shape {shape} takes {size} bytes, "
                           f"its offsets [{begin}, {end}) say {end - begin}")
    return dtype, tuple(shape), begin, end
