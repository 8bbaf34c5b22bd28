"""The block record codec: how a slice of hidden states becomes the bytes of one
``hidden_states.blocks`` record, and back, bit-exactly.

Layout of a record value::

    b"HSXB" | u32 little-endian header length | header (JSON BlockHeader) | payload

With ``byteplane-zstd`` the raw little-endian bytes are split into byte planes
(every element's byte 0, then every element's byte 1, ...) and each plane is
zstd-compressed on its own: the sign/exponent bytes of bfloat16 hidden states are
highly repetitive and compress well once separated from the noisy mantissa bytes.
A plane that would not shrink is stored raw. ``zstd`` (whole block) and ``none``
remain for comparison. The header carries a CRC-32 of the raw bytes, checked on
every decode.
"""

from __future__ import annotations

import struct
import threading
import zlib
from typing_extensions import Buffer

import numpy as np
import orjson
import zstandard
from pydantic import ValidationError

from schemas.blocks import BlockHeader, Codec, DType, Segment

MAGIC = b"HSXB"
_PREFIX = struct.Struct("<4sI")
MAX_HEADER_BYTES = 64 * 1024
DEFAULT_LEVEL = 1


class CorruptBlock(ValueError):
    """A block record that cannot be decoded or fails its checksum."""


# zstandard compressor/decompressor objects are not safe to share between
# threads; one per thread per level keeps encoding on a pool cheap.
_local = threading.local()


def _compressor(level: int) -> zstandard.ZstdCompressor:
    cache = _local.__dict__.setdefault("compressors", {})
    if level not in cache:
        cache[level] = zstandard.ZstdCompressor(level=level)
    return cache[level]


def _decompressor() -> zstandard.ZstdDecompressor:
    if not hasattr(_local, "decompressor"):
        _local.decompressor = zstandard.ZstdDecompressor()
    return _local.decompressor


def checksum(raw: Buffer) -> str:
    """The checksum format used in block headers and manifests."""
    return f"crc32:{zlib.crc32(raw) & 0xFFFFFFFF:08x}"


def encode_block(
    raw: Buffer,
    *,
    shape: tuple[int, int, int],
    dtype: DType,
    token_start: int,
    codec: Codec = Codec.BYTEPLANE_ZSTD,
    level: int = DEFAULT_LEVEL,
) -> bytes:
    """Encode the raw bytes of a C-contiguous ``[tokens, layers, hidden]`` array.

    ``raw`` is any buffer (``bytes``, ``memoryview``, a numpy array); the GIL is
    released while zstd works, so blocks can be encoded on a thread pool.
    """
    view = memoryview(raw).cast("B")
    expected = shape[0] * shape[1] * shape[2] * dtype.itemsize
    if view.nbytes != expected:
        raise ValueError(f"{view.nbytes} raw bytes do not match shape {shape} of {dtype.value}")
    segments, parts = _compress(view, codec, dtype.itemsize, level)
    header = BlockHeader(
        codec=codec,
        dtype=dtype,
        shape=shape,
        token_start=token_start,
        token_end=token_start + shape[0],
        checksum=checksum(view),
        segments=segments,
    )
    header_bytes = header.model_dump_json().encode()
    return b"".join([_PREFIX.pack(MAGIC, len(header_bytes)), header_bytes, *parts])


def _compress(
    view: memoryview, codec: Codec, itemsize: int, level: int
) -> tuple[list[Segment], list[Buffer]]:
    if codec is Codec.NONE:
        return [Segment(encoding="raw", nbytes=view.nbytes)], [view]
    if codec is Codec.ZSTD:
        planes: list[Buffer] = [view]
    else:
        # One transposing copy: row i holds byte i of every element.
        planes = list(np.frombuffer(view, dtype=np.uint8).reshape(-1, itemsize).T.copy())
    segments, parts = [], []
    compressor = _compressor(level)
    for plane in planes:
        packed = compressor.compress(plane)
        if len(packed) < memoryview(plane).nbytes:
            segments.append(Segment(encoding="zstd", nbytes=len(packed)))
            parts.append(packed)
        else:
            segments.append(Segment(encoding="raw", nbytes=memoryview(plane).nbytes))
            parts.append(plane)
    return segments, parts


def read_header(value: Buffer) -> tuple[BlockHeader, memoryview]:
    """Parse and validate a record's header; returns it with the payload view."""
    view = memoryview(value).cast("B")
    if view.nbytes < _PREFIX.size:
        raise CorruptBlock(f"block record of {view.nbytes} bytes is shorter than its prefix")
    magic, header_len = _PREFIX.unpack_from(view)
    if magic != MAGIC:
        raise CorruptBlock(f"not a block record (magic {bytes(magic)!r})")
    if header_len > MAX_HEADER_BYTES or _PREFIX.size + header_len > view.nbytes:
        raise CorruptBlock(f"header length {header_len} exceeds the record")
    try:
        header = BlockHeader.model_validate(orjson.loads(view[_PREFIX.size : _PREFIX.size + header_len]), strict=False)
    except (orjson.JSONDecodeError, ValidationError) as exc:
        raise CorruptBlock(f"invalid block header: {exc}") from exc
    return header, view[_PREFIX.size + header_len :]


def decode_block(value: Buffer) -> tuple[BlockHeader, bytes]:
    """Decode a record to its header and raw bytes, verifying sizes and checksum.
    Raises :class:`CorruptBlock` on any mismatch."""
    header, payload = read_header(value)
    if sum(s.nbytes for s in header.segments) != payload.nbytes:
        raise CorruptBlock(f"payload is {payload.nbytes} bytes, header says {sum(s.nbytes for s in header.segments)}")
    expected_planes = header.dtype.itemsize if header.codec is Codec.BYTEPLANE_ZSTD else 1
    if len(header.segments) != expected_planes:
        raise CorruptBlock(f"{len(header.segments)} segments for codec {header.codec.value}, expected {expected_planes}")
    plane_size = header.raw_nbytes // expected_planes
    planes = []
    offset = 0
    for segment in header.segments:
        chunk = payload[offset : offset + segment.nbytes]
        offset += segment.nbytes
        planes.append(_expand(chunk, segment, plane_size))
    if header.codec is Codec.BYTEPLANE_ZSTD:
        # Interleave the planes back: stacking along axis 1 writes each element's
        # bytes side by side in one pass (``stack(planes).T.tobytes()`` reads with
        # a plane-sized stride and was 4-10x slower).
        raw = np.stack([np.frombuffer(p, dtype=np.uint8) for p in planes], axis=1).tobytes()
    else:
        raw = planes[0]
    if checksum(raw) != header.checksum:
        raise CorruptBlock(f"checksum mismatch: {checksum(raw)} != {header.checksum}")
    return header, raw


def _expand(chunk: memoryview, segment: Segment, size: int) -> bytes:
    if segment.encoding == "raw":
        if chunk.nbytes != size:
            raise CorruptBlock(f"raw segment of {chunk.nbytes} bytes, expected {size}")
        return bytes(chunk)
    try:
        out = _decompressor().decompress(chunk, max_output_size=size)
    except zstandard.ZstdError as exc:
        raise CorruptBlock(f"zstd segment does not decompress: {exc}") from exc
    if len(out) != size:
        raise CorruptBlock(f"zstd segment holds {len(out)} bytes, expected {size}")
    return out
