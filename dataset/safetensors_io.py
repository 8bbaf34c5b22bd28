"""Safetensors, streamed: the shard writer (reading: :mod:`hsx.dataset.shard_reader`).

The format is small: an 8-byte little-endian header length ``N``, ``N`` bytes of
JSON (``{name: {dtype, shape, data_offsets: [begin, end]}, "__metadata__": {…}}``),
then the tensors' bytes back to back. safetensors' API writes either a whole
buffer (``save``: a second copy of the shard in memory) or a path
(``save_file``); neither streams into a multipart upload, so the sink writes the
format itself, and safetensors' own ``safe_open`` reads the result (the tests
check it).
"""

from __future__ import annotations

import struct
from functools import cache
from typing import TYPE_CHECKING, Any

import orjson

from hsx.dataset.file_copy import copy_range
from hsx.dataset.sample import FileRange, Pieces
from hsx.dataset.storage import Writer

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
def torch_dtypes() -> dict[str, torch.dtype]:
    """The torch dtype of each of safetensors' dtype names."""
    return {name: dtype for dtype, name in _names().items()}


def safetensors_dtype(dtype: torch.dtype) -> str:
    """safetensors' name of ``dtype`` (``F32``, ``BOOL``...), as :meth:`LocalShard.describe` gives it."""
    return _names()[dtype]


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
        return torch_dtypes()[tensor.dtype].itemsize
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
