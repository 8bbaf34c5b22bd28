"""Safetensors, streamed: the shard writer, and the reader of shards in an object
store.

The format is small: an 8-byte little-endian header length ``N``, ``N`` bytes of
JSON (``{name: {dtype, shape, data_offsets: [begin, end]}, "__metadata__": {…}}``),
then the tensors' bytes back to back. safetensors' API writes either a whole
buffer (``save``: a second copy of the shard in memory) or a path
(``save_file``); neither streams into a multipart upload, so the sink writes the
format itself, and safetensors' own ``safe_open`` reads the result (the tests
check it). Likewise ``safe_open`` maps only local files: :class:`RemoteShard`
reads the header once and then each tensor with a ranged read.

Both kinds of open shard (:class:`LocalShard`, :class:`RemoteShard`) check a
shard's header before anything is sized from it, and raise :class:`CorruptShard`
for a shard that is not what its header or its index says.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

import orjson
from safetensors import SafetensorError, safe_open

from hsx.dataset.file_copy import copy_range
from hsx.dataset.sample import FileRange, Pieces
from hsx.dataset.storage import Storage, Writer
from hsx.runtime.errors import HsxError

if TYPE_CHECKING:  # torch is imported where tensors are made: `hsx.open_dataset` imports without it
    import torch


@cache
def _names() -> dict[torch.dtype, str]:
    """safetensors' name of each torch dtype."""
    import torch

    return {torch.float64: "F64", torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16",
            torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
            torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2"}


@cache
def _dtypes() -> dict[str, torch.dtype]:
    return {name: dtype for dtype, name in _names().items()}


def safetensors_dtype(dtype: torch.dtype) -> str:
    """safetensors' name of ``dtype`` (``F32``, ``BOOL``...), as :meth:`LocalShard.describe` gives it."""
    return _names()[dtype]


_HEADER_GUESS = 256 << 10
"""The first read of a remote shard: the header of a shard of ~2,000 samples."""
MAX_HEADER_BYTES = 100_000_000
"""The longest header safetensors itself reads (its ``MAX_HEADER_SIZE``): a longer
declared length is damage, not a header to fetch."""


def write_safetensors(out: Writer, tensors: dict[str, torch.Tensor | Pieces | FileRange],
                      metadata: dict[str, str]) -> int:
    """Write ``tensors`` and ``metadata`` to ``out`` as one safetensors file,
    tensor by tensor (no copy of the whole); return its size. Widest elements
    first, so every tensor starts at a multiple of its element size.
    :class:`Pieces` and a :class:`FileRange` are 1-D uint8 tensors, written
    piece by piece and copied from their file (:func:`copy_range`)."""
    order = sorted(tensors, key=lambda name: -_width(tensors[name]))  # stable: given order per width
    header: dict[str, Any] = {"__metadata__": metadata} if metadata else {}
    offset = 0
    for name in order:
        offset = _place(header, name, tensors[name], offset)
    encoded = orjson.dumps(header)
    encoded += b" " * (-len(encoded) % 8)  # padded as safetensors pads it: tensors stay 8-byte aligned
    out.write(struct.pack("<Q", len(encoded)))
    out.write(encoded)
    for name in order:
        write_tensor(out, tensors[name])
    return 8 + len(encoded) + offset


def write_tensor(out: Writer, tensor: torch.Tensor | Pieces | FileRange) -> None:
    """Append a tensor's bytes to ``out``: :class:`Pieces` piece by piece, a
    :class:`FileRange` copied from its file (:func:`copy_range`)."""
    if isinstance(tensor, FileRange):
        copy_range(tensor, out)
    elif isinstance(tensor, Pieces):
        for part in tensor.parts:
            out.write(part)
    else:
        out.write(_as_bytes(tensor))


class HeadTooLarge(OSError):
    """A streamed shard's header and leading tensors do not fit the room kept for them."""


def streamed_layout(front: dict[str, torch.Tensor], placed: dict[str, tuple[int, FileRange]], room: int,
                    back: dict[str, torch.Tensor], metadata: dict[str, str]) -> tuple[bytes, list[memoryview]]:
    """The layout of a shard streamed to its file (see :mod:`hsx.dataset.spool`):
    ``placed`` tensors are in the file already, back to back from offset ``room``
    (each with its offset there); ``front`` tensors (8-byte elements) end exactly
    at ``room``, after the header padded with spaces; ``back`` tensors (1-byte
    elements) follow the placed ones. Returns the file's first ``room`` bytes
    (length, header, front tensors) and the back tensors' bytes, in order.
    :class:`HeadTooLarge` where the header and the front tensors outgrow ``room``."""
    front_bytes = sum(tensor.numel() * tensor.element_size() for tensor in front.values())
    data_start = room - front_bytes
    placed_end = room + sum(len(stored) for _, stored in placed.values())
    header: dict[str, Any] = {"__metadata__": metadata} if metadata else {}
    offset = 0
    for name, tensor in front.items():
        assert tensor.element_size() == 8, name  # so data_start stays 8-byte aligned
        offset = _place(header, name, tensor, offset)
    for name, (at, stored) in placed.items():
        _place(header, name, stored, at - data_start)
    offset = placed_end - data_start
    for name, tensor in back.items():
        assert tensor.element_size() == 1, name
        offset = _place(header, name, tensor, offset)
    encoded = orjson.dumps(header)
    if 8 + len(encoded) > data_start:
        raise HeadTooLarge(f"a header of {len(encoded)} bytes and {front_bytes} bytes of leading tensors do not "
                           f"fit the {room} bytes kept for them")
    head = b"".join([struct.pack("<Q", data_start - 8), encoded, b" " * (data_start - 8 - len(encoded)),
                     *(_as_bytes(tensor) for tensor in front.values())])
    return head, [_as_bytes(tensor) for tensor in back.values()]


def _width(tensor: torch.Tensor | Pieces | FileRange) -> int:
    if isinstance(tensor, Pieces):
        return 1
    if isinstance(tensor, FileRange):
        return _dtypes()[tensor.dtype].itemsize
    return tensor.element_size()


def tensor_layout(tensor: torch.Tensor | Pieces | FileRange) -> tuple[str, tuple[int, ...], int]:
    """A tensor's safetensors dtype, shape and size in bytes: :class:`Pieces`
    are 1-D ``U8``, a :class:`FileRange` is what it says."""
    if isinstance(tensor, Pieces):
        return "U8", (len(tensor),), len(tensor)
    if isinstance(tensor, FileRange):
        return tensor.dtype, tensor.shape or (len(tensor),), len(tensor)
    return _names()[tensor.dtype], tuple(tensor.shape), tensor.numel() * tensor.element_size()


def _place(header: dict[str, Any], name: str, tensor: torch.Tensor | Pieces | FileRange, offset: int) -> int:
    """Enter ``tensor`` in ``header`` at data offset ``offset``; return the offset after it."""
    dtype, shape, size = tensor_layout(tensor)
    header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + size]}
    return offset + size


def _as_bytes(tensor: torch.Tensor) -> memoryview:
    import torch

    flat = tensor.contiguous().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy()).cast("B") if flat.numel() else memoryview(b"")


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
        return _names()[dtype], shape

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
        dtype, shape, (begin, end) = _dtypes()[entry["dtype"]], entry["shape"], entry["data_offsets"]
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
