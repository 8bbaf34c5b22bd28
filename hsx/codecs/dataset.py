"""Dataset codecs: how one sample's ``[tokens, layers, hidden]`` hidden states may
be stored in a shard. These are pure functions, so the sink can call them to
write and every reader can call them to read.

* ``raw``: the little-endian bytes themselves. Any safetensors reader loads them.
* ``byteplane-zstd``: one or more block records (:mod:`hsx.codecs.block`) back to
  back. The sink can keep the records as they arrived, with no re-encode, because
  each record says how long it is. Lossless; each block's CRC-32 is checked on read.
* ``fp8``: E4M3 codes with a float32 scale per token and layer
  (:mod:`hsx.codecs.fp8`, which documents the error bound), framed as
  ``b"HSX8" | u32 header length | JSON Fp8Header | scales | codes``.
* ``fp8-zstd``: the same frame with each part zstd-compressed. Plain zstd, not
  byte planes: fp8 elements are one byte wide, and splitting them into nibble
  planes gained nothing per sample on SmolLM2 states (``bench.dataset_codecs``).

fp8 frames carry a CRC-32 of the scales followed by the codes, so a damaged
payload fails with :class:`~hsx.codecs.block.CorruptBlock` and never turns into
wrong numbers.
"""

from __future__ import annotations

import math

import numpy as np
from typing_extensions import Buffer

from hsx.codecs.block import checksum, decode_block, encode_block, read_header
from hsx.codecs.framing import CorruptBlock, frame, read_frame
from hsx.codecs.segments import check_segments, pack_segment, unpack_segment
from hsx.codecs.fp8 import from_fp8, narrow, to_fp8, widen
from hsx.schemas.blocks import MAGIC, BlockHeader, Codec, DType, Segment
from hsx.schemas.dataset_codec import FP8_MAGIC, DatasetCodec, Fp8Header

FP8_ZSTD_LEVEL = 1
"""zstd's level for fp8 codes. Per sample on SmolLM2, level 3 saved 0.2 % more and
encoded about 4 % slower (``bench.dataset_codecs``)."""


Shape = tuple[int, int, int]


def encode_sample(raw: Buffer, *, shape: Shape, dtype: DType, codec: DatasetCodec,
                  level: int | None = None) -> bytes:
    """Encode the raw little-endian bytes of one sample's ``[tokens, layers,
    hidden]`` hidden states of ``dtype``. ``level`` is zstd's (defaults per codec)."""
    codec = DatasetCodec(codec)
    expected = int(np.prod(shape)) * dtype.itemsize
    if memoryview(raw).nbytes != expected:
        raise ValueError(f"{memoryview(raw).nbytes} raw bytes do not match shape {tuple(shape)} of {dtype.value}")
    if codec is DatasetCodec.RAW:
        return bytes(raw)
    if codec is DatasetCodec.BYTEPLANE_ZSTD:
        return encode_block(raw, shape=shape, dtype=dtype, token_start=0, codec=Codec.BYTEPLANE_ZSTD,
                            **({} if level is None else {"level": level}))
    codes, scales = to_fp8(widen(raw, shape, dtype))
    return encode_fp8_sample(codes, scales, dtype=dtype, codec=codec, level=level)


def encode_fp8_sample(codes: np.ndarray, scales: np.ndarray, *, dtype: DType, codec: DatasetCodec,
                      level: int | None = None) -> bytes:
    """An ``fp8`` or ``fp8-zstd`` sample of codes and scales quantized already
    (:func:`hsx.codecs.fp8.to_fp8`, or fp8 block records as the connector sent
    them): the codes are stored as they are, never widened and quantized again."""
    codec = DatasetCodec(codec)
    if codec not in (DatasetCodec.FP8, DatasetCodec.FP8_ZSTD) or codes.dtype != np.uint8 or codes.ndim != 3 \
            or scales.shape != codes.shape[:2]:
        raise ValueError(f"{codec.value} cannot store fp8 codes {codes.dtype} {codes.shape} with scales {scales.shape}")
    parts: list[Buffer] = [np.ascontiguousarray(scales, dtype="<f4"), np.ascontiguousarray(codes)]
    if codec is DatasetCodec.FP8_ZSTD:
        packed = [pack_segment(part, FP8_ZSTD_LEVEL if level is None else level) for part in parts]
    else:
        packed = [(Segment(encoding="raw", nbytes=memoryview(part).nbytes), part) for part in parts]
    header = Fp8Header(codec=codec.value, dtype=dtype, shape=codes.shape, checksum=checksum(*parts),
                       segments=[segment for segment, _ in packed])
    return frame(FP8_MAGIC, header, [part for _, part in packed])


def decode_sample(payload: Buffer, *, shape: Shape, dtype: DType, codec: DatasetCodec) -> bytes:
    """The raw little-endian bytes of ``dtype`` of a sample stored with ``codec``:
    the original bytes for the lossless codecs, dequantized values for fp8. Raises
    :class:`~hsx.codecs.block.CorruptBlock` when the payload is damaged or does not
    hold ``shape``."""
    codec = DatasetCodec(codec)
    if codec is DatasetCodec.RAW:
        expected = math.prod(shape) * dtype.itemsize  # exact: numpy's product wraps at 2**63 (to 0 for 2**64)
        if memoryview(payload).nbytes != expected:
            raise CorruptBlock(f"raw sample of {memoryview(payload).nbytes} bytes, shape {tuple(shape)} of "
                               f"{dtype.value} needs {expected}")
        return bytes(payload)
    if codec is DatasetCodec.BYTEPLANE_ZSTD:
        return _decode_records(payload, tuple(shape), dtype)
    codes, scales = read_fp8(payload, shape)
    return narrow(from_fp8(codes, scales), dtype).tobytes()


def read_fp8(payload: Buffer, shape: Shape | None = None) -> tuple[np.ndarray, np.ndarray]:
    """An fp8 sample's verified ``(codes [T, L, H] uint8, scales [T, L] float32)``,
    for readers that keep fp8 (e.g. an fp8 export) rather than dequantize."""
    header, body = read_frame(payload, FP8_MAGIC, Fp8Header, "fp8 sample")
    if shape is not None and header.shape != tuple(shape):
        raise CorruptBlock(f"fp8 sample holds shape {header.shape}, expected {tuple(shape)}")
    tokens, layers, hidden = header.shape
    sizes = (tokens * layers * 4, tokens * layers * hidden)
    check_segments(header.segments, sizes, body, "fp8 sample")
    split = header.segments[0].nbytes
    scales_bytes = unpack_segment(body[:split], header.segments[0], sizes[0])
    codes_bytes = unpack_segment(body[split:], header.segments[1], sizes[1])
    actual = checksum(scales_bytes, codes_bytes)
    if actual != header.checksum:
        raise CorruptBlock(f"fp8 checksum mismatch: {actual} != {header.checksum}")
    scales = np.frombuffer(scales_bytes, dtype="<f4").astype(np.float32).reshape(tokens, layers)
    return np.frombuffer(codes_bytes, dtype=np.uint8).reshape(header.shape), scales


def split_records(payload: Buffer) -> list[memoryview]:
    """Block records written back to back, one view each. A record's length is its
    prefix and header plus the segments its header lists."""
    view = memoryview(payload).cast("B")
    records, offset = [], 0
    while offset < view.nbytes:
        header, body = read_frame(view[offset:], MAGIC, BlockHeader, "block record")
        length = view.nbytes - offset - body.nbytes + sum(s.nbytes for s in header.segments)
        if length > view.nbytes - offset:
            raise CorruptBlock(f"block record at byte {offset} runs past the sample's end")
        records.append(view[offset : offset + length])
        offset += length
    return records


def _decode_records(payload: Buffer, shape: Shape, dtype: DType) -> bytes:
    """Block records back to back, tiling the sample's tokens from 0 in order.
    Each record's header is checked against the sample's shape before the record
    is decoded: a record declaring more than the sample holds is refused before
    a buffer is sized from it."""
    parts, tokens = [], 0
    for i, record in enumerate(split_records(payload)):
        header, _ = read_header(record)
        if header.quantization is not None:
            raise CorruptBlock(f"block record {i} holds {header.quantization} rows, a byteplane-zstd sample their bytes")
        if (header.dtype is not dtype or header.shape[1:] != shape[1:] or header.token_start != tokens
                or header.token_end > shape[0]):
            raise CorruptBlock(f"block record {i} holds tokens [{header.token_start}, {header.token_end}) of "
                               f"{header.shape[1:]} {header.dtype.value}, expected tokens from {tokens} up to "
                               f"{shape[0]} of {shape[1:]} {dtype.value}")
        _, raw = decode_block(record)
        parts.append(raw)
        tokens = header.token_end
    if tokens != shape[0]:
        raise CorruptBlock(f"block records hold {tokens} tokens, the sample has {shape[0]}")
    return b"".join(parts)
