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
"""

from __future__ import annotations

import struct
from collections.abc import Iterable
from functools import cache
from typing import TYPE_CHECKING, Any

import orjson
from safetensors import safe_open

from hsx.dataset.storage import Storage, Writer

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

_HEADER_GUESS = 256 << 10
"""The first read of a remote shard: the header of a shard of ~2,000 samples."""


def write_safetensors(out: Writer, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> int:
    """Write ``tensors`` and ``metadata`` to ``out`` as one safetensors file,
    tensor by tensor (no copy of the whole); return its size. Widest elements
    first, so every tensor starts at a multiple of its element size."""
    order = sorted(tensors, key=lambda name: -tensors[name].element_size())  # stable: given order per width
    header: dict[str, Any] = {"__metadata__": metadata} if metadata else {}
    offset = 0
    for name in order:
        tensor = tensors[name]
        size = tensor.numel() * tensor.element_size()
        header[name] = {"dtype": _names()[tensor.dtype], "shape": list(tensor.shape), "data_offsets": [offset, offset + size]}
        offset += size
    encoded = orjson.dumps(header)
    encoded += b" " * (-len(encoded) % 8)  # padded as safetensors pads it: tensors stay 8-byte aligned
    out.write(struct.pack("<Q", len(encoded)))
    out.write(encoded)
    for name in order:
        out.write(_as_bytes(tensors[name]))
    return 8 + len(encoded) + offset


def _as_bytes(tensor: torch.Tensor) -> memoryview:
    import torch

    flat = tensor.contiguous().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy()).cast("B") if flat.numel() else memoryview(b"")


def open_shard(storage: Storage, relative: str) -> Any:
    """An open shard with ``safe_open``'s reading methods (``keys``, ``metadata``,
    ``get_tensor``, ``get_slice``): memory-mapped where the dataset is on a file
    system, else a :class:`RemoteShard`. :class:`FileNotFoundError` when absent."""
    path = storage.local_path(relative)
    if path is None:
        return RemoteShard(storage, relative)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such shard")
    return safe_open(str(path), framework="pt")


def prefetch(shard: Any, names: Iterable[str]) -> None:
    """Read these tensors of a remote shard in one go (in parallel, nearby ones
    coalesced); a no-op for a memory-mapped one, whose pages come on demand."""
    if isinstance(shard, RemoteShard):
        shard.prefetch(names)


class CorruptShard(ValueError):
    """A shard whose header or bytes are not what safetensors says they must be."""


class RemoteShard:
    """A shard in an object store: its header read once (one ranged read for
    most shards), then only the bytes of the tensors asked for."""

    def __init__(self, storage: Storage, relative: str) -> None:
        self._storage, self._relative = storage, relative
        first = storage.read_ranges(relative, [(0, _HEADER_GUESS)])[0]
        if len(first) < 8:
            raise CorruptShard(f"shard {relative}: {len(first)} bytes, too short for a safetensors header")
        (length,) = struct.unpack_from("<Q", first)
        raw = bytes(first[8:8 + length])
        if len(raw) < length:
            raw += bytes(storage.read_ranges(relative, [(len(first), 8 + length)])[0])
        try:
            header = orjson.loads(raw)
            self._metadata: dict[str, str] | None = header.pop("__metadata__", None)
            self._entries: dict[str, tuple[torch.dtype, list[int], int, int]] = {
                name: (_dtypes()[e["dtype"]], e["shape"], *e["data_offsets"]) for name, e in header.items()}
        except (orjson.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
            raise CorruptShard(f"shard {relative}: not a safetensors header ({exc})") from exc
        self._base = 8 + length
        self._fetched: dict[str, memoryview] = {}

    def keys(self) -> list[str]:
        return list(self._entries)

    def metadata(self) -> dict[str, str] | None:
        return self._metadata

    def nbytes(self, name: str) -> int:
        begin, end = self._range(name)
        return end - begin

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
            raise KeyError(f"shard {self._relative} holds no tensor {name!r}")
        _, _, begin, end = self._entries[name]
        return self._base + begin, self._base + end
