"""fp8 block records (codec version 2): what ``hsx extract --wire-dtype fp8``
sends instead of the rows' bytes of the model's dtype, and how the sink reads it.

The record keeps the framing of :mod:`hsx.codecs.block` (``b"HSXB"`` | u32 header
length | JSON :class:`~hsx.schemas.blocks.BlockHeader` | payload). Its header says
``codec_version: 2`` and ``quantization: "fp8"``; ``dtype`` stays the model's,
which the rows dequantize to. The payload is two parts, each one segment:

1. the scales, ``[tokens, layers]`` little-endian float32, ``amax / 448``;
2. the codes, ``[tokens, layers, hidden]`` uint8 bit patterns of E4M3FN.

Each part is zstd-compressed unless the codec is ``none`` (or compressing would
not shrink it). The CRC-32 covers what was sent, the raw scales then the raw
codes, so the sink can keep the codes bit for bit without ever widening them.

Why this layout: the quantization (:mod:`hsx.codecs.fp8`) is what the dataset's
``fp8`` codec stores too, so the sink moves codes and scales from the wire into a
shard unchanged; one scale per token and layer costs 4 bytes per ``hidden``
codes (0.7 % on SmolLM2's 576).

A version 1 reader rejects these records (its header allows version 1 only), so
a sink must be upgraded before an extractor sends fp8.
"""

from __future__ import annotations

import numpy as np
from typing_extensions import Buffer

from hsx.codecs.block import checksum
from hsx.codecs.framing import CorruptBlock, Record, frame, framed
from hsx.codecs.segments import DEFAULT_LEVEL, pack_segment
from hsx.codecs.fp8 import E4M3_MAX, MIN_SCALE, to_fp8, widen
from hsx.schemas.blocks import MAGIC, BlockHeader, Codec, DType, Segment

MAX_CODE = 0x7E
"""The E4M3FN code of 448 (``amax / 448`` scaling puts each row's largest magnitude there)."""


def encode_fp8_block(codes: Buffer, scales: Buffer, *, shape: tuple[int, int, int], dtype: DType,
                     token_start: int, codec: Codec = Codec.BYTEPLANE_ZSTD, level: int = DEFAULT_LEVEL) -> bytes:
    """One record of ``[tokens, layers, hidden]`` E4M3FN ``codes`` (uint8) and
    their ``[tokens, layers]`` float32 ``scales`` (little-endian), quantized from
    rows of ``dtype``. Any buffers; the GIL is released while zstd works."""
    return frame(MAGIC, *_encode(codes, scales, shape, dtype, token_start, codec, level))


def encode_fp8_record(codes: Buffer, scales: Buffer, *, shape: tuple[int, int, int], dtype: DType,
                      token_start: int, codec: Codec = Codec.BYTEPLANE_ZSTD, level: int = DEFAULT_LEVEL,
                      joined: bool = False) -> Record:
    """:func:`encode_fp8_block`'s record with its header, as pieces or ``joined``
    (:func:`~hsx.codecs.block.encode_block_record`)."""
    return framed(MAGIC, *_encode(codes, scales, shape, dtype, token_start, codec, level), joined=joined)


def _encode(codes: Buffer, scales: Buffer, shape: tuple[int, int, int], dtype: DType, token_start: int,
            codec: Codec, level: int) -> tuple[BlockHeader, list[Buffer]]:
    tokens, layers, hidden = shape
    parts = [memoryview(scales).cast("B"), memoryview(codes).cast("B")]
    if [p.nbytes for p in parts] != [tokens * layers * 4, tokens * layers * hidden]:
        raise ValueError(f"{parts[0].nbytes} scale and {parts[1].nbytes} code bytes do not match shape {shape}")
    if codec is Codec.NONE:
        packed: list[tuple[Segment, Buffer]] = [(Segment(encoding="raw", nbytes=p.nbytes), p) for p in parts]
    else:
        packed = [pack_segment(part, level) for part in parts]
    header = BlockHeader(codec_version=2, quantization="fp8", codec=codec, dtype=dtype, shape=shape,
                         token_start=token_start, token_end=token_start + tokens, checksum=checksum(*parts),
                         segments=[segment for segment, _ in packed])
    return header, [part for _, part in packed]


def fp8_rows(header: BlockHeader, raw: bytes) -> tuple[np.ndarray, np.ndarray]:
    """The ``(codes [T, L, H] uint8, scales [T, L] float32)`` of an fp8 block
    that :func:`hsx.codecs.block.decode_block` returned (so sizes and CRC are
    verified), checked to be what ``amax / 448`` quantization can produce:
    :class:`~hsx.codecs.block.CorruptBlock` names the first token and layer that is
    not. A CRC only proves the bytes arrived as sent; this catches a sender that
    sent something else (a NaN code, a scale that does not fit its codes)."""
    if header.quantization != "fp8":
        raise CorruptBlock(f"block of tokens [{header.token_start}, {header.token_end}) is not fp8")
    tokens, layers, hidden = header.shape
    split = tokens * layers * 4
    scales = np.frombuffer(raw, dtype="<f4", count=tokens * layers).astype(np.float32).reshape(tokens, layers)
    codes = np.frombuffer(raw, dtype=np.uint8, offset=split).reshape(header.shape)
    bad_scale = ~(np.isfinite(scales) & (scales >= MIN_SCALE))
    largest = (codes & 0x7F).max(axis=-1)
    # A row whose scale is above the floor had amax / scale == 448; below it
    # (zeros, or values under 448 * 2**-126) its codes stay under 448.
    bad = bad_scale | (largest > MAX_CODE) | ((scales > MIN_SCALE) & (largest != MAX_CODE))
    if bad.any():
        t, layer = (int(i) for i in np.argwhere(bad)[0])
        raise CorruptBlock(
            f"malformed fp8 row at token {header.token_start + t}, layer {layer}: scale {scales[t, layer]!r} with "
            f"largest code 0x{int(largest[t, layer]):02x} (amax/{E4M3_MAX:.0f} scaling puts 0x{MAX_CODE:02x} there; "
            "0x7f is NaN)")
    return codes, scales


def quantize_block(raw: Buffer, *, shape: tuple[int, int, int], dtype: DType, token_start: int,
                   codec: Codec = Codec.BYTEPLANE_ZSTD, level: int = DEFAULT_LEVEL) -> bytes:
    """The fp8 record of rows given as raw bytes of ``dtype``, quantized in numpy
    (:func:`hsx.codecs.fp8.to_fp8`, the same codes and scales as the connector's
    torch): for tests and tools without torch. ``ValueError`` on non-finite rows."""
    codes, scales = to_fp8(widen(raw, shape, dtype))
    return encode_fp8_block(codes, scales.astype("<f4"), shape=shape, dtype=dtype, token_start=token_start,
                            codec=codec, level=level)
