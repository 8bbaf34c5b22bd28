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
every decode, and one of the payload as stored, which a sink that keeps the record
as it came checks instead of decoding it (:func:`verify_stored`). Codec version 2
blocks carry fp8 rows instead (:mod:`hsx.codecs.fp8_blocks`).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypeVar

from typing_extensions import Buffer

import numpy as np
import orjson
import zstandard
from isal import isal_zlib
from pydantic import BaseModel, ValidationError

from hsx.schemas.blocks import FRAME_PREFIX, MAGIC, MAX_HEADER_BYTES, BlockHeader, Codec, DType, Segment

H = TypeVar("H", bound=BaseModel)

DEFAULT_LEVEL = 1


class CorruptBlock(ValueError):
    """A block record that cannot be decoded or fails its checksum."""


# zstandard compressor/decompressor objects are not safe to share between
# threads; one per thread per level keeps encoding on a pool cheap.
_local = threading.local()


def _compressor(level: int) -> zstandard.ZstdCompressor:
    cache = _local.__dict__.setdefault("compressors", {})
    if level not in cache:
        cache[level] = (zstandard.ZstdCompressor(compression_params=_PLANE_PARAMETERS) if level == DEFAULT_LEVEL
                        else zstandard.ZstdCompressor(level=level))
    return cache[level]


_PLANE_PARAMETERS = zstandard.ZstdCompressionParameters.from_level(DEFAULT_LEVEL, hash_log=6, min_match=7)
"""zstd's parameters at the default level, tuned for hidden-state byte planes.

Why: a hidden-state byte plane has almost no repeats for zstd's match finder,
so at level 1 it spent most of its time looking for them. A 64-entry hash table
and 7-byte minimum matches leave zstd a Huffman coder of literals: on SmolLM2's
planes 2.4x faster to encode and 2.1x faster to decode, for 0.3 % more bytes
(``python -m bench --only dataset_codecs``). Decoders need nothing: these are
the encoder's choices, the frames are ordinary zstd. Other levels are zstd's own
(the benchmarks compare them)."""


def _decompressor() -> zstandard.ZstdDecompressor:
    if not hasattr(_local, "decompressor"):
        _local.decompressor = zstandard.ZstdDecompressor()
    return _local.decompressor


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
    return frame(MAGIC, *_encode(memoryview(raw).cast("B"), shape, dtype, token_start, codec, level))


@dataclass(frozen=True)
class Record:
    """One record's bytes as pieces, its framing and header first, and the header
    they carry: whoever sends it writes the pieces one by one or joins them
    (:meth:`value`). Each piece is its own (none is a view of a reused buffer or
    of the rows it was encoded from)."""

    header: BlockHeader
    pieces: list[Buffer]

    @property
    def nbytes(self) -> int:
        return sum(memoryview(piece).nbytes for piece in self.pieces)

    def value(self) -> bytes:
        """The record value: the pieces back to back."""
        return self.pieces[0] if len(self.pieces) == 1 and isinstance(self.pieces[0], bytes) else b"".join(self.pieces)

    def joined(self) -> Record:
        """The same record as one piece: what a Kafka record needs (joined where it is
        encoded, on the pool, rather than where it is produced, under a lock)."""
        return Record(self.header, [self.value()])


def encode_block_record(
    raw: Buffer,
    *,
    shape: tuple[int, int, int],
    dtype: DType,
    token_start: int,
    codec: Codec = Codec.BYTEPLANE_ZSTD,
    level: int = DEFAULT_LEVEL,
) -> Record:
    """:func:`encode_block`'s record as pieces, not joined: by reference, the
    connector writes them to the staged object as they are (a join would copy
    every byte once more)."""
    return framed(MAGIC, *_encode(memoryview(raw).cast("B"), shape, dtype, token_start, codec, level))


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
        planes = list(_split_planes(view, itemsize))
    packed = [pack_segment(plane, level) for plane in planes]
    return [segment for segment, _ in packed], [part for _, part in packed]


def _split_planes(view: memoryview, itemsize: int) -> np.ndarray:
    """``[itemsize, count]``: row i holds byte i of every little-endian element,
    in a reused per-thread buffer (valid until this thread's next call).

    Why shifts: byte i of an element is its word shifted right by ``8 * i`` and
    truncated, which numpy runs at memory speed; the transposing copy this
    replaced (``reshape(-1, itemsize).T.copy()``) wrote bytes with a stride and ran
    at about half of it, into fresh pages every block."""
    count = view.nbytes // itemsize
    planes = _scratch("split", view.nbytes).reshape(itemsize, count)
    words = np.frombuffer(view, dtype=_WORDS[itemsize])
    np.copyto(planes[0], words, casting="unsafe")  # unsigned narrowing keeps the low byte
    shifted = _scratch("shifted", view.nbytes).view(_WORDS[itemsize])
    for i in range(1, itemsize):
        np.right_shift(words, 8 * i, out=shifted)
        np.copyto(planes[i], shifted, casting="unsafe")
    return planes


def pack_segment(plane: Buffer, level: int = DEFAULT_LEVEL) -> tuple[Segment, Buffer]:
    """One payload segment: ``plane`` zstd-compressed, or as it is where that
    would not shrink it."""
    packed = _compressor(level).compress(plane)
    if len(packed) < memoryview(plane).nbytes:
        return Segment(encoding="zstd", nbytes=len(packed)), packed
    return Segment(encoding="raw", nbytes=memoryview(plane).nbytes), plane


def unpack_segment(chunk: memoryview, segment: Segment, size: int) -> bytes:
    """The ``size`` bytes a segment holds (its own copy); :class:`CorruptBlock` if
    it holds any other number or does not decompress."""
    if segment.encoding == "raw":
        _check_raw(chunk, size)
        return bytes(chunk)
    return _decompress(chunk, size)


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


ZSTD_MAX_RATIO = 1 << 15
"""The most raw bytes one byte of zstd can stand for: a run-length block of
128 KiB (zstd's largest) costs 4 bytes, its 3-byte header and the byte repeated."""


def check_segments(segments: Sequence[Segment], sizes: Sequence[int], payload: memoryview, what: str) -> None:
    """:class:`CorruptBlock` unless ``payload`` is exactly ``segments`` back to back
    and each segment can hold its size in ``sizes``: a raw one is that size, a zstd
    one is at least ``1 / ZSTD_MAX_RATIO`` of it. A header declaring gigabytes
    over a few bytes of payload (a forged or broken record) is refused here,
    before any buffer is sized from it."""
    if len(segments) != len(sizes):
        raise CorruptBlock(f"{what} has {len(segments)} segments, its header's codec needs {len(sizes)}")
    declared = sum(s.nbytes for s in segments)
    if declared != payload.nbytes:
        raise CorruptBlock(f"{what} payload is {payload.nbytes} bytes, header says {declared}")
    for i, (segment, size) in enumerate(zip(segments, sizes)):
        if segment.encoding == "raw" and segment.nbytes != size:
            raise CorruptBlock(f"{what} segment {i} is {segment.nbytes} raw bytes, its header needs {size}")
        if segment.encoding == "zstd" and size > segment.nbytes * ZSTD_MAX_RATIO:
            raise CorruptBlock(f"{what} segment {i} of {segment.nbytes} zstd bytes cannot hold the {size} its "
                               f"header declares")


def read_frame(value: Buffer, magic: bytes, model: type[H], what: str) -> tuple[H, memoryview]:
    """Parse ``magic | u32 header length | JSON header | payload``, the framing of
    block records and of fp8 samples, validating the header as ``model``."""
    view = memoryview(value).cast("B")
    if view.nbytes < FRAME_PREFIX.size:
        raise CorruptBlock(f"{what} of {view.nbytes} bytes is shorter than its prefix")
    found, header_len = FRAME_PREFIX.unpack_from(view)
    if found != magic:
        raise CorruptBlock(f"not a {what} (magic {bytes(found)!r})")
    if header_len > MAX_HEADER_BYTES or FRAME_PREFIX.size + header_len > view.nbytes:
        raise CorruptBlock(f"header length {header_len} exceeds the {what}")
    try:
        header = model.model_validate(orjson.loads(view[FRAME_PREFIX.size : FRAME_PREFIX.size + header_len]), strict=False)
    except (orjson.JSONDecodeError, ValidationError) as exc:
        raise CorruptBlock(f"invalid {what.split()[0]} header: {exc}") from exc
    return header, view[FRAME_PREFIX.size + header_len :]


def frame(magic: bytes, header: BaseModel, parts: list[Buffer]) -> bytes:
    """``magic | u32 header length | JSON header | parts``: one record's bytes.
    Unset (``None``) fields are left out, so that a header field added later
    (``quantization``) leaves the records without it exactly as they were."""
    return b"".join(_framing(magic, header) + parts)


def framed(magic: bytes, header: BlockHeader, parts: list[Buffer]) -> Record:
    """:func:`frame`'s bytes as a :class:`Record` of pieces, the parts that are
    views (raw segments: of the caller's rows, of a reused buffer) copied."""
    owned = [part if isinstance(part, bytes) else bytes(part) for part in parts]
    return Record(header, _framing(magic, header) + owned)


def _framing(magic: bytes, header: BaseModel) -> list[Buffer]:
    header_bytes = header.model_dump_json(exclude_none=True).encode()
    return [FRAME_PREFIX.pack(magic, len(header_bytes)), header_bytes]


def decode_block(value: Buffer, out: memoryview | None = None) -> tuple[BlockHeader, Buffer]:
    """Decode a record to its header and raw bytes, verifying sizes and checksum.
    Raises :class:`CorruptBlock` on any mismatch. With ``out`` (writable, unquantized
    blocks only), the raw bytes are decoded into it, which they must fill, and ``out``
    is returned: a sample's blocks decode into its one buffer, copied never."""
    header, payload = read_header(value)
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
        _check_raw(payload, header.raw_nbytes)
        if out is None:
            raw = bytes(payload)  # the caller gets bytes of its own, not a view of the record
        else:
            out[:] = payload
            raw = out
    elif out is None:
        raw = _decompress(payload, header.raw_nbytes)
    else:
        _decompress_into(payload, np.frombuffer(out, dtype=np.uint8))
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
    if header is None:
        header, payload = read_header(value)
    else:
        view = memoryview(value).cast("B")
        payload = view[view.nbytes - sum(segment.nbytes for segment in header.segments):]
    if header.payload_checksum is None:
        decode_block(value, out=memoryview(_scratch("verify", header.raw_nbytes)))
    else:
        _check_payload(header, payload)
    return header


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


_WORDS = {2: np.dtype("<u2"), 4: np.dtype("<u4")}
_SCRATCH_MAX = 32 << 20
"""Blocks up to this many raw bytes decode in per-thread buffers that are kept;
larger ones (not cut by the connector) get buffers of their own."""


def _decode_planes(header: BlockHeader, payload: memoryview, out: memoryview | None = None) -> Buffer:
    """Each plane decompressed straight into a row of a reused buffer, then the
    planes interleaved into elements by word arithmetic.

    Why this shape: on one core the decode was spending as much time faulting in
    fresh pages (a new ``bytes`` per plane, per stack, per copy; glibc hands 1 MiB
    blocks back to the kernel on free) as in zstd; reused buffers leave one fresh
    allocation, the returned ``bytes`` (none with ``out``). Widening the top plane to the element's
    little-endian integer and shifting each lower plane in runs at memory speed,
    where writing bytes with an element-sized stride (``np.stack(..., axis=1)``)
    did not."""
    itemsize = header.dtype.itemsize
    count = header.raw_nbytes // itemsize
    planes = _scratch("planes", header.raw_nbytes).reshape(itemsize, count)
    offset = 0
    for plane, segment in zip(planes, header.segments):
        chunk = payload[offset : offset + segment.nbytes]
        offset += segment.nbytes
        if segment.encoding == "raw":
            _check_raw(chunk, count)
            plane[:] = np.frombuffer(chunk, dtype=np.uint8)
        else:
            _decompress_into(chunk, plane)
    target = _scratch("words", header.raw_nbytes) if out is None else np.frombuffer(out, dtype=np.uint8)
    words = target.view(_WORDS[itemsize])
    np.copyto(words, planes[-1])
    for plane in planes[-2::-1]:
        words <<= 8
        words |= plane
    return words.tobytes() if out is None else out


def _scratch(name: str, nbytes: int) -> np.ndarray:
    """A per-thread uint8 buffer of at least ``nbytes``, reused across calls."""
    if nbytes > _SCRATCH_MAX:
        return np.empty(nbytes, dtype=np.uint8)
    buffers = _local.__dict__.setdefault("scratch", {})
    buffer = buffers.get(name)
    if buffer is None or buffer.nbytes < nbytes:
        buffer = buffers[name] = np.empty(max(nbytes, 1 << 20), dtype=np.uint8)
    return buffer[:nbytes]


def _check_raw(chunk: memoryview, size: int) -> None:
    if chunk.nbytes != size:
        raise CorruptBlock(f"raw segment of {chunk.nbytes} bytes, expected {size}")


def _decompress(chunk: memoryview, size: int) -> bytes:
    """The ``size`` bytes of one zstd frame. ``max_output_size`` bounds only a frame
    that does not record its content size: one that does is decompressed into a
    buffer of the size it records, whatever that is (2**40 was a MemoryError), so
    that size is checked against ``size`` first."""
    try:
        declared = zstandard.frame_content_size(chunk)
        if declared not in (-1, size):  # -1: not recorded
            raise CorruptBlock(f"zstd segment declares {declared} bytes, expected {size}")
        out = _decompressor().decompress(chunk, max_output_size=size)
    except zstandard.ZstdError as exc:
        raise CorruptBlock(f"zstd segment does not decompress: {exc}") from exc
    if len(out) != size:
        raise CorruptBlock(f"zstd segment holds {len(out)} bytes, expected {size}")
    return out


def _decompress_into(chunk: memoryview, out: np.ndarray) -> None:
    """Decompress one zstd frame into ``out``, which it must fill exactly."""
    target = memoryview(out).cast("B")
    filled = 0
    try:
        with _decompressor().stream_reader(chunk, read_across_frames=False) as reader:
            while filled < target.nbytes:
                got = reader.readinto(target[filled:])
                if not got:
                    break
                filled += got
            extra = reader.read(1)
    except zstandard.ZstdError as exc:
        raise CorruptBlock(f"zstd segment does not decompress: {exc}") from exc
    if filled != target.nbytes or extra:
        held = f"more than {target.nbytes}" if extra else str(filled)
        raise CorruptBlock(f"zstd segment holds {held} bytes, expected {target.nbytes}")
