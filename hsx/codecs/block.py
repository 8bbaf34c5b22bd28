"""The block record codec: how a slice of hidden states becomes the bytes of one
``hidden_states.blocks`` record, and back, bit-exactly.

Layout of a record value::

    b"HSXB" | u32 little-endian header length | header (JSON BlockHeader) | payload

With ``byteplane-zstd`` the raw little-endian bytes are split into byte planes
(every element's byte 0, then every element's byte 1, ...) and each plane is
zstd-compressed on its own: the sign/exponent bytes of bfloat16 hidden states are
highly repetitive and compress well once separated from the noisy mantissa bytes.
A plane zstd would not shrink by 5 % (tried on its first 64 KiB) is stored
raw (:func:`~hsx.codecs.segments.pack_segment`). ``zstd`` (whole block) and ``none``
remain for comparison. The header carries a CRC-32 of the raw bytes, checked on
every decode, and one of the payload as stored, which a sink that keeps the record
as it came checks instead of decoding it (:func:`verify_stored`). Codec version 2
blocks carry fp8 rows instead (:mod:`hsx.codecs.fp8_blocks`).
"""

from __future__ import annotations

from collections.abc import Sequence

from typing_extensions import Buffer

import numpy as np
from isal import isal_zlib

from hsx.codecs.framing import CorruptBlock, Record, framed, read_frame
from hsx.codecs.planes import interleave_planes, scratch, split_planes
from hsx.codecs.segments import (DEFAULT_LEVEL, check_raw, check_segments, decompress, decompress_into, pack_segment,
                                 unpack_segment)
from hsx.schemas.blocks import MAGIC, BlockHeader, Codec, DType, Segment

def checksum(*parts: Buffer) -> str:
    """The checksum format used in block headers and manifests, of ``parts``
    back to back (without joining them)."""
    crc = 0
    for part in parts:
        crc = isal_zlib.crc32(part, crc)
    return f"crc32:{crc & 0xFFFFFFFF:08x}"


def combined_checksum(headers: Sequence[BlockHeader]) -> str:
    """The checksum of the blocks' raw bytes back to back, from their own
    checksums and sizes (CRC32's combine rule): a sample's checksum without its
    raw bytes in memory."""
    crc = 0
    for header in headers:
        crc = isal_zlib.crc32_combine(crc, int(header.checksum.removeprefix("crc32:"), 16), header.raw_nbytes)
    return f"crc32:{crc & 0xFFFFFFFF:08x}"


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
    return encode_block_record(raw, shape=shape, dtype=dtype, token_start=token_start, codec=codec, level=level,
                               joined=True).value()


def encode_block_record(
    raw: Buffer,
    *,
    shape: tuple[int, int, int],
    dtype: DType,
    token_start: int,
    codec: Codec = Codec.BYTEPLANE_ZSTD,
    level: int = DEFAULT_LEVEL,
    joined: bool = False,
) -> Record:
    """:func:`encode_block`'s record with its header: as pieces, not joined (by
    reference, the connector writes them to the staged object as they are: a join
    would copy every byte once more), or ``joined`` into one (a Kafka record's
    value)."""
    return framed(MAGIC, *_encode(memoryview(raw).cast("B"), shape, dtype, token_start, codec, level), joined=joined)


def _encode(view: memoryview, shape: tuple[int, int, int], dtype: DType, token_start: int, codec: Codec,
            level: int) -> tuple[BlockHeader, list[Buffer]]:
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
        payload_checksum=checksum(*parts),
    )
    return header, parts


def _compress(
    view: memoryview, codec: Codec, itemsize: int, level: int
) -> tuple[list[Segment], list[Buffer]]:
    if codec is Codec.NONE:
        return [Segment(encoding="raw", nbytes=view.nbytes)], [view]
    if codec is Codec.ZSTD:
        planes: list[Buffer] = [view]
    else:
        planes = list(split_planes(view, itemsize))
    packed = [pack_segment(plane, level) for plane in planes]
    return [segment for segment, _ in packed], [part for _, part in packed]


def read_header(value: Buffer) -> tuple[BlockHeader, memoryview]:
    """Parse and validate a record's header, and check that its payload can hold
    what the header declares (:func:`check_segments`); returns the header with
    the payload view. Nothing is sized from the header before this passes."""
    header, payload = read_frame(value, MAGIC, BlockHeader, "block record")
    check_segments(header.segments, segment_sizes(header), payload, "block")
    return header, payload


def segment_sizes(header: BlockHeader) -> list[int]:
    """The raw bytes each of a block's segments must decode to."""
    if header.quantization is not None:
        return header.part_nbytes
    if header.codec is Codec.BYTEPLANE_ZSTD:
        return [header.raw_nbytes // header.dtype.itemsize] * header.dtype.itemsize
    return [header.raw_nbytes]


def decode_block(value: Buffer, out: memoryview | None = None,
                 header: BlockHeader | None = None) -> tuple[BlockHeader, Buffer]:
    """Decode a record to its header and raw bytes, verifying sizes and checksum.
    Raises :class:`CorruptBlock` on any mismatch. With ``out`` (writable, unquantized
    blocks only), the raw bytes are decoded into it, which they must fill, and ``out``
    is returned: a sample's blocks decode into its one buffer, copied never. Given
    ``header``, the one :func:`read_header` returned for ``value``, that is not done again."""
    header, payload = _parsed(value, header)
    _check_payload(header, payload)
    if out is not None and header.quantization is not None:
        raise CorruptBlock(f"the block holds {header.quantization} rows, raw bytes were expected")
    if out is not None and out.nbytes != header.raw_nbytes:
        raise CorruptBlock(f"the block holds {header.raw_nbytes} raw bytes, {out.nbytes} were expected")
    raw: Buffer
    if header.quantization is not None:
        raw = _decode_parts(header, payload)
    elif header.codec is Codec.BYTEPLANE_ZSTD:
        raw = _decode_planes(header, payload, out)
    elif header.segments[0].encoding == "raw":
        check_raw(payload, header.raw_nbytes)
        if out is None:
            raw = bytes(payload)  # the caller gets bytes of its own, not a view of the record
        else:
            out[:] = payload
            raw = out
    elif out is None:
        raw = decompress(payload, header.raw_nbytes)
    else:
        decompress_into(payload, np.frombuffer(out, dtype=np.uint8))
        raw = out
    actual = checksum(raw)
    if actual != header.checksum:
        raise CorruptBlock(f"checksum mismatch: {actual} != {header.checksum}")
    return header, raw


def verify_stored(value: Buffer, header: BlockHeader | None = None) -> BlockHeader:
    """Check a record that is stored as it came, whose raw bytes nobody keeps:
    its header, its payload's framing (:func:`read_header`; given ``header``, the
    one it returned for ``value``, that is not done again) and its payload
    checksum, without decoding it; the raw checksum is checked where it is read
    (:func:`decode_block`). A record without a payload checksum (written before
    it existed) is decoded into a reused per-thread buffer and checked against
    its raw checksum instead. Unquantized blocks only."""
    header, payload = _parsed(value, header)
    if header.payload_checksum is None:
        decode_block(value, out=memoryview(scratch("verify", header.raw_nbytes)))
    else:
        _check_payload(header, payload)
    return header


def _parsed(value: Buffer, header: BlockHeader | None) -> tuple[BlockHeader, memoryview]:
    """:func:`read_header` of ``value``; given ``header``, the one it returned for
    ``value``, that header and the payload it frames (the record's last bytes)."""
    if header is None:
        return read_header(value)
    view = memoryview(value).cast("B")
    return header, view[view.nbytes - sum(segment.nbytes for segment in header.segments):]


def _check_payload(header: BlockHeader, payload: memoryview) -> None:
    if header.payload_checksum is not None and (actual := checksum(payload)) != header.payload_checksum:
        raise CorruptBlock(f"payload checksum mismatch: {actual} != {header.payload_checksum}")


def _decode_parts(header: BlockHeader, payload: memoryview) -> bytes:
    """A quantized block's parts (``header.part_nbytes``), each one segment, back to back."""
    parts, offset = [], 0
    for segment, size in zip(header.segments, header.part_nbytes):
        parts.append(unpack_segment(payload[offset : offset + segment.nbytes], segment, size))
        offset += segment.nbytes
    return b"".join(parts)


def _decode_planes(header: BlockHeader, payload: memoryview, out: memoryview | None = None) -> Buffer:
    """Each plane decompressed straight into a row of a reused buffer, then the
    planes interleaved into elements by word arithmetic.

    Why this shape: on one core the decode was spending as much time faulting in
    fresh pages (a new ``bytes`` per plane, per stack, per copy; glibc hands 1 MiB
    blocks back to the kernel on free) as in zstd; reused buffers leave one fresh
    allocation, the returned ``bytes`` (none with ``out``)."""
    itemsize = header.dtype.itemsize
    count = header.raw_nbytes // itemsize
    planes = scratch("planes", header.raw_nbytes).reshape(itemsize, count)
    offset = 0
    for plane, segment in zip(planes, header.segments):
        chunk = payload[offset : offset + segment.nbytes]
        offset += segment.nbytes
        if segment.encoding == "raw":
            check_raw(chunk, count)
            plane[:] = np.frombuffer(chunk, dtype=np.uint8)
        else:
            decompress_into(chunk, plane)
    target = scratch("words", header.raw_nbytes) if out is None else np.frombuffer(out, dtype=np.uint8)
    words = interleave_planes(planes, target)
    return words.tobytes() if out is None else out


