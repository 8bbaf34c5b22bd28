"""The block codec: bit-exact round trips for every dtype and codec, and every
kind of damage detected."""

from __future__ import annotations

import struct

import numpy as np
import pytest
import torch

from hsx.codecs.block import checksum, decode_block, encode_block, encode_block_record, read_header
from hsx.codecs.framing import CorruptBlock
from hsx.codecs.segments import PROBE_BYTES, pack_segment
from hsx.runtime.tensors import TORCH_DTYPES
from hsx.schemas import Codec, DType


def raw_bytes(tensor: torch.Tensor) -> np.ndarray:
    """The tensor's bytes as uint8 (numpy has no bfloat16)."""
    return tensor.contiguous().view(torch.uint8).numpy()


def hidden_like(tokens: int, dtype: DType, seed: int = 0) -> torch.Tensor:
    """Random data with hidden-state statistics: mostly small values, a few large
    outlier channels, some exact zeros and special values."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, 3, 64, generator=gen) * 0.5
    x[:, :, 7] *= 300.0
    x[0, 0, :4] = torch.tensor([0.0, -0.0, float("inf"), float("nan")])
    return x.to(TORCH_DTYPES[dtype])


@pytest.mark.parametrize("dtype", list(DType))
@pytest.mark.parametrize("codec", list(Codec))
@pytest.mark.parametrize("tokens", [1, 17, 300])
def test_round_trip_is_bit_exact(dtype: DType, codec: Codec, tokens: int) -> None:
    x = hidden_like(tokens, dtype, seed=tokens)
    value = encode_block(raw_bytes(x), shape=tuple(x.shape), dtype=dtype, token_start=5, codec=codec)
    header, raw = decode_block(value)
    assert raw == raw_bytes(x).tobytes()  # bit-exact, NaN payloads and -0.0 included
    assert (header.token_start, header.token_end, header.shape, header.dtype) == (5, 5 + tokens, (tokens, 3, 64), dtype)
    assert header.checksum == checksum(raw_bytes(x))


def test_byte_planes_beat_plain_zstd_on_bfloat16() -> None:
    x = hidden_like(256, DType.BFLOAT16)
    sizes = {c: len(encode_block(raw_bytes(x), shape=tuple(x.shape), dtype=DType.BFLOAT16, token_start=0, codec=c))
             for c in Codec}
    assert sizes[Codec.BYTEPLANE_ZSTD] < sizes[Codec.ZSTD] < sizes[Codec.NONE]


def test_incompressible_planes_are_stored_raw() -> None:
    x = hidden_like(256, DType.FLOAT32)
    header, _ = read_header(encode_block(raw_bytes(x), shape=tuple(x.shape), dtype=DType.FLOAT32, token_start=0))
    assert len(header.segments) == 4
    assert header.segments[0].encoding == "raw"  # the lowest mantissa byte is noise
    assert header.segments[3].encoding == "zstd"  # sign and high exponent bits repeat


def test_a_plane_is_compressed_only_where_its_probe_pays() -> None:
    """zstd tries a plane's first PROBE_BYTES before the rest: noise (bfloat16's
    low bytes) is stored raw without compressing it whole, a plane whose bytes
    repeat is compressed; the probe alone decides, so the same plane is always
    packed the same way. A small plane is compressed whole where that shrinks it."""
    rng = np.random.default_rng(0)
    noise = rng.integers(0, 256, 4 * PROBE_BYTES, dtype=np.uint8)
    exponents = rng.integers(118, 126, 4 * PROBE_BYTES, dtype=np.uint8)  # 3 bits of 8: saves more than half
    assert [pack_segment(plane)[0].encoding for plane in (noise, exponents)] == ["raw", "zstd"]
    segment, part = pack_segment(noise)
    assert segment.nbytes == noise.nbytes and bytes(part) == noise.tobytes()
    noise_then_zeros = np.concatenate([noise[:PROBE_BYTES], np.zeros(3 * PROBE_BYTES, np.uint8)])
    assert pack_segment(noise_then_zeros)[0].encoding == "raw"
    small = noise[: 2 * PROBE_BYTES].copy()
    small[PROBE_BYTES:] = 0
    assert pack_segment(small)[0].encoding == "zstd"


@pytest.mark.parametrize("dtype", [DType.BFLOAT16, DType.FLOAT32])
@pytest.mark.parametrize("codec", list(Codec))
def test_a_record_in_pieces_is_the_record_and_owns_its_bytes(dtype: DType, codec: Codec) -> None:
    """The connector writes a staged block piece by piece after this thread encoded
    others: no piece may be a view of the thread's reused plane buffer (float32's
    low planes are stored raw) or of the rows, which go back to their pool."""
    first, second = hidden_like(64, dtype, seed=1), hidden_like(64, dtype, seed=2)
    rows = raw_bytes(first).copy()
    record = encode_block_record(rows, shape=tuple(first.shape), dtype=dtype, token_start=3, codec=codec)
    expected = encode_block(raw_bytes(first), shape=tuple(first.shape), dtype=dtype, token_start=3, codec=codec)
    encode_block(raw_bytes(second), shape=tuple(second.shape), dtype=dtype, token_start=0, codec=codec)
    rows[:] = 0
    assert b"".join(bytes(piece) for piece in record.pieces) == record.value() == expected
    assert record.nbytes == len(expected)
    assert record.header == read_header(expected)[0]
    joined = encode_block_record(raw_bytes(first), shape=tuple(first.shape), dtype=dtype, token_start=3, codec=codec,
                                 joined=True)
    assert joined.pieces == [expected] and joined.header == record.header


def _encoded(codec: Codec = Codec.BYTEPLANE_ZSTD) -> bytes:
    x = hidden_like(64, DType.BFLOAT16)
    return encode_block(raw_bytes(x), shape=tuple(x.shape), dtype=DType.BFLOAT16, token_start=0, codec=codec)


@pytest.mark.parametrize("codec", list(Codec))
def test_every_flipped_payload_byte_is_detected(codec: Codec) -> None:
    value = bytearray(_encoded(codec))
    header_end = len(value) - sum(s.nbytes for s in read_header(bytes(value))[0].segments)
    for position in range(header_end, len(value), max(1, (len(value) - header_end) // 200)):
        damaged = bytearray(value)
        damaged[position] ^= 0x10
        with pytest.raises(CorruptBlock):
            decode_block(bytes(damaged))


@pytest.mark.parametrize("cut", [0, 3, 8, 40, -1, -100])
def test_truncated_block_is_detected(cut: int) -> None:
    value = _encoded()
    with pytest.raises(CorruptBlock):
        decode_block(value[:cut])


@pytest.mark.parametrize(
    "mangle, message",
    [
        (lambda v: b"XXXX" + v[4:], "not a block record"),
        (lambda v: v[:4] + struct.pack("<I", 10**6) + v[8:], "header length"),
        (lambda v: v[:8] + b"x" + v[9:], "invalid block header"),
        (lambda v: v + b"extra", "payload is"),
    ],
)
def test_damaged_framing_is_detected(mangle, message: str) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(CorruptBlock, match=message):
        decode_block(mangle(_encoded()))


def test_shape_must_match_bytes() -> None:
    with pytest.raises(ValueError, match="do not match shape"):
        encode_block(b"\0" * 10, shape=(1, 1, 4), dtype=DType.FLOAT32, token_start=0)


@pytest.mark.parametrize("dtype", list(DType))
@pytest.mark.parametrize("codec", list(Codec))
def test_round_trip_is_bit_exact_on_real_hidden_states(real_hidden_states: torch.Tensor, dtype: DType,
                                                       codec: Codec) -> None:
    x = real_hidden_states.to(TORCH_DTYPES[dtype])
    _, raw = decode_block(encode_block(raw_bytes(x), shape=tuple(x.shape), dtype=dtype, token_start=0, codec=codec))
    assert raw == raw_bytes(x).tobytes()
