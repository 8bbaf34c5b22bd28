"""One payload segment of a record: a plane (or a part) zstd-compressed, or as
it is where that would not pay; zstd's contexts kept per thread."""

from __future__ import annotations

import threading
from collections.abc import Sequence

from typing_extensions import Buffer

import numpy as np
import zstandard

from hsx.codecs.framing import CorruptBlock
from hsx.schemas.blocks import Segment

DEFAULT_LEVEL = 1
"""zstd's level unless a codec is given another: the tuned parameters below."""

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


PROBE_BYTES = 64 << 10
"""How much of a plane zstd tries before it compresses the rest (planes of at
most twice this are compressed whole)."""
MIN_SAVING = 0.05
"""The share of its probe zstd must save for a plane to be compressed.

Why: bfloat16's low byte plane (mantissa bits) is noise. zstd, tuned as below,
shrinks SmolLM2's to 0.9998 of its size for 0.21 CPU-seconds per GB of hidden
states, a fifth of what the connector spends encoding; its probe costs 0.03.
A plane that saves 5 % of half a bfloat16 block saves 2.5 % of it."""


def pack_segment(plane: Buffer, level: int = DEFAULT_LEVEL) -> tuple[Segment, Buffer]:
    """One payload segment: ``plane`` zstd-compressed, or as it is where that
    does not pay: zstd saves less than :data:`MIN_SAVING` of the plane's first
    :data:`PROBE_BYTES`, or nothing of the whole. Deterministic: the same plane
    is always packed the same way."""
    view = memoryview(plane).cast("B")
    compressor = _compressor(level)
    if view.nbytes > 2 * PROBE_BYTES and len(compressor.compress(view[:PROBE_BYTES])) > (1 - MIN_SAVING) * PROBE_BYTES:
        return Segment(encoding="raw", nbytes=view.nbytes), plane
    packed = compressor.compress(view)
    if len(packed) < view.nbytes:
        return Segment(encoding="zstd", nbytes=len(packed)), packed
    return Segment(encoding="raw", nbytes=view.nbytes), plane


def unpack_segment(chunk: memoryview, segment: Segment, size: int) -> bytes:
    """The ``size`` bytes a segment holds (its own copy); :class:`CorruptBlock` if
    it holds any other number or does not decompress."""
    if segment.encoding == "raw":
        check_raw(chunk, size)
        return bytes(chunk)
    return decompress(chunk, size)


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


def check_raw(chunk: memoryview, size: int) -> None:
    if chunk.nbytes != size:
        raise CorruptBlock(f"raw segment of {chunk.nbytes} bytes, expected {size}")


def decompress(chunk: memoryview, size: int) -> bytes:
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


def decompress_into(chunk: memoryview, out: np.ndarray) -> None:
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
