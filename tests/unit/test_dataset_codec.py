"""Dataset codecs: every codec round-trips (lossless ones bit-exact, fp8 within its
bound), byteplane-zstd samples are block records back to back as they arrived,
and damage is detected with a clear error."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hsx.codecs.block import encode_block
from hsx.codecs.framing import CorruptBlock
from hsx.codecs.dataset import decode_sample, encode_sample, read_fp8
from hsx.codecs.fp8 import error_bound, widen
from hsx.runtime.tensors import TORCH_DTYPES
from hsx.schemas import DType
from hsx.schemas.blocks import FRAME_PREFIX
from hsx.schemas.dataset_codec import DatasetCodec

SHAPE = (37, 3, 64)


def sample(dtype: DType, shape: tuple[int, int, int] = SHAPE, seed: int = 0) -> bytes:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=gen) * 0.5
    x[:, :, 7] *= 300.0
    x[0, 0, :2] = torch.tensor([0.0, -0.0])
    return x.to(TORCH_DTYPES[dtype]).contiguous().view(torch.uint8).numpy().tobytes()


@pytest.mark.parametrize("dtype", list(DType))
@pytest.mark.parametrize("codec", list(DatasetCodec))
def test_round_trip(dtype: DType, codec: DatasetCodec) -> None:
    raw = sample(dtype)
    back = decode_sample(encode_sample(raw, shape=SHAPE, dtype=dtype, codec=codec), shape=SHAPE, dtype=dtype,
                         codec=codec)
    assert len(back) == len(raw)
    if codec.lossless:
        assert back == raw
    else:
        x, y = widen(raw, SHAPE, dtype), widen(back, SHAPE, dtype)
        _, scales = read_fp8(encode_sample(raw, shape=SHAPE, dtype=dtype, codec=codec))
        assert (np.abs(y - x) <= error_bound(x, scales)).all()


def test_fp8_zstd_is_smaller_than_fp8_and_both_decode_alike() -> None:
    raw = sample(DType.BFLOAT16)
    plain, packed = (encode_sample(raw, shape=SHAPE, dtype=DType.BFLOAT16, codec=c)
                     for c in (DatasetCodec.FP8, DatasetCodec.FP8_ZSTD))
    assert len(packed) < len(plain) < len(raw)
    assert [a.tobytes() for a in read_fp8(plain)] == [a.tobytes() for a in read_fp8(packed)]


def test_byteplane_samples_are_the_block_records_as_they_came() -> None:
    raw, row = sample(DType.BFLOAT16), 3 * 64 * 2
    records = [encode_block(raw[start * row : end * row], shape=(end - start, 3, 64), dtype=DType.BFLOAT16,
                            token_start=start) for start, end in ((0, 10), (10, 11), (11, 37))]
    assert decode_sample(b"".join(records), shape=SHAPE, dtype=DType.BFLOAT16,
                         codec=DatasetCodec.BYTEPLANE_ZSTD) == raw
    with pytest.raises(CorruptBlock, match="expected tokens from 10"):
        decode_sample(records[0] + records[2], shape=SHAPE, dtype=DType.BFLOAT16, codec=DatasetCodec.BYTEPLANE_ZSTD)
    with pytest.raises(CorruptBlock, match="hold 11 tokens, the sample has 37"):
        decode_sample(records[0] + records[1], shape=SHAPE, dtype=DType.BFLOAT16, codec=DatasetCodec.BYTEPLANE_ZSTD)
    with pytest.raises(CorruptBlock, match="runs past the sample's end"):
        decode_sample(b"".join(records)[:-5], shape=SHAPE, dtype=DType.BFLOAT16, codec=DatasetCodec.BYTEPLANE_ZSTD)
    with pytest.raises(CorruptBlock, match="float32"):
        decode_sample(b"".join(records), shape=SHAPE, dtype=DType.FLOAT32, codec=DatasetCodec.BYTEPLANE_ZSTD)


@pytest.mark.parametrize("codec", [c for c in DatasetCodec if c is not DatasetCodec.RAW])
def test_every_flipped_payload_byte_is_detected(codec: DatasetCodec) -> None:
    value = encode_sample(sample(DType.BFLOAT16), shape=SHAPE, dtype=DType.BFLOAT16, codec=codec)
    header_end = FRAME_PREFIX.size + FRAME_PREFIX.unpack_from(value)[1]
    for position in range(header_end, len(value), max(1, (len(value) - header_end) // 150)):
        damaged = bytearray(value)
        damaged[position] ^= 0x10
        with pytest.raises(CorruptBlock):
            decode_sample(bytes(damaged), shape=SHAPE, dtype=DType.BFLOAT16, codec=codec)


@pytest.mark.parametrize("codec, message", [
    (DatasetCodec.RAW, "raw sample of 100 bytes"),
    (DatasetCodec.FP8, "not a fp8 sample"),
    (DatasetCodec.FP8_ZSTD, "not a fp8 sample"),
    (DatasetCodec.BYTEPLANE_ZSTD, "not a block record"),
])
def test_the_wrong_payload_is_named(codec: DatasetCodec, message: str) -> None:
    with pytest.raises(CorruptBlock, match=message):
        decode_sample(b"x" * 100, shape=SHAPE, dtype=DType.BFLOAT16, codec=codec)


def test_an_fp8_sample_of_another_shape_is_refused() -> None:
    value = encode_sample(sample(DType.FLOAT32), shape=SHAPE, dtype=DType.FLOAT32, codec=DatasetCodec.FP8)
    with pytest.raises(CorruptBlock, match="holds shape \\(37, 3, 64\\), expected \\(36, 3, 64\\)"):
        decode_sample(value, shape=(36, 3, 64), dtype=DType.FLOAT32, codec=DatasetCodec.FP8)


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(ValueError, match="do not match shape"):
        encode_sample(b"\0" * 10, shape=SHAPE, dtype=DType.BFLOAT16, codec=DatasetCodec.FP8)
    with pytest.raises(ValueError, match="is not a valid DatasetCodec"):
        encode_sample(sample(DType.BFLOAT16), shape=SHAPE, dtype=DType.BFLOAT16, codec="fp4")  # type: ignore[arg-type]


def test_real_hidden_states_round_trip(real_hidden_states: torch.Tensor) -> None:
    x = real_hidden_states.to(torch.bfloat16).contiguous()
    raw, shape = x.view(torch.uint8).numpy().tobytes(), tuple(x.shape)
    for codec in DatasetCodec:
        value = encode_sample(raw, shape=shape, dtype=DType.BFLOAT16, codec=codec)
        back = decode_sample(value, shape=shape, dtype=DType.BFLOAT16, codec=codec)
        if codec.lossless:
            assert back == raw
        else:
            expected, scales = x.float().numpy(), read_fp8(value)[1]
            assert (np.abs(widen(back, shape, DType.BFLOAT16) - expected) <= error_bound(expected, scales)).all()
