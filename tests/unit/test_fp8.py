"""fp8 (E4M3FN) in numpy: the same codes as torch for every kind of float32, the
documented error bound on real and synthetic hidden states, clear errors on
values fp8 cannot hold."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hsx.codecs.fp8 import E4M3_VALUES, e4m3_codes, error_bound, from_fp8, narrow, scales_for, to_fp8, widen
from hsx.runtime.tensors import TORCH_DTYPES
from hsx.schemas import DType


def test_codes_match_torch_on_every_kind_of_float32() -> None:
    rng = np.random.default_rng(0)
    values = rng.integers(0, 2**32, size=400_000, dtype=np.uint64).astype(np.uint32).view(np.float32)
    edges = [0.0, -0.0, 448, 449, 463.99, 464, 464.01, 480, 1e30, np.inf, -np.inf, 2**-9, 2**-10, 3 * 2**-10,
             2**-6, 0.99 * 2**-6, 1.0625, 1.1875]
    values = np.concatenate([values, rng.standard_normal(100_000).astype(np.float32) * 50,
                             np.array(edges, dtype=np.float32)])
    values = values[~np.isnan(values)]  # torch keeps a NaN's payload bits; hidden states hold none
    expected = torch.from_numpy(values).to(torch.float8_e4m3fn).view(torch.uint8).numpy()
    assert np.array_equal(e4m3_codes(values), expected)


def test_value_table_matches_torch() -> None:
    expected = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float().numpy()
    assert np.array_equal(E4M3_VALUES, expected, equal_nan=True)


@pytest.mark.parametrize("dtype", list(DType))
def test_widen_and_narrow_are_exact_inverses(dtype: DType) -> None:
    x = (torch.randn(5, 3, 16, generator=torch.Generator().manual_seed(1)) * 10).to(TORCH_DTYPES[dtype])
    raw = x.view(torch.uint8).numpy().tobytes()
    widened = widen(raw, (5, 3, 16), dtype)
    assert np.array_equal(widened, x.float().numpy())
    assert narrow(widened, dtype).tobytes() == raw


def test_narrow_to_bfloat16_rounds_as_torch() -> None:
    values = np.random.default_rng(2).standard_normal(10_000).astype(np.float32) * 1e3
    expected = torch.from_numpy(values).to(torch.bfloat16).view(torch.uint8).numpy()
    assert np.array_equal(narrow(values, DType.BFLOAT16), expected)


def test_each_row_maximum_maps_to_448() -> None:
    x = np.zeros((3, 2, 8), dtype=np.float32)
    x[0, 0, 3], x[1, 1, 0], x[2, 0, 5] = 1.0, -3e-3, 1e30  # row (0, 1) stays all zero
    codes, scales = to_fp8(x)
    assert scales[0, 1] == np.float32(2.0**-126) and (codes[0, 1] == 0).all()
    assert codes[0, 0, 3] == 0x7E and codes[1, 1, 0] == 0xFE and codes[2, 0, 5] == 0x7E  # ±448
    assert np.array_equal(scales, scales_for(x))


def hidden_like(seed: int = 0) -> np.ndarray:
    """Hidden-state statistics: a few outlier channels, exact zeros, rows of zeros."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((40, 3, 64)).astype(np.float32) * 0.5
    x[:, :, 7] *= 300.0
    x[0, 0, :4] = [0.0, -0.0, 1e-30, -1e-7]
    x[1, 2] = 0.0
    return x


def test_round_trip_is_within_the_documented_bound() -> None:
    x = hidden_like()
    codes, scales = to_fp8(x)
    back = from_fp8(codes, scales)
    assert codes.shape == x.shape and scales.shape == x.shape[:2] and scales.dtype == np.float32
    assert (np.abs(back - x) <= error_bound(x, scales)).all()
    normal = np.abs(x) >= scales[..., None] * 2.0**-6
    assert (np.abs(back - x)[normal] <= 2.0**-4 * np.abs(x)[normal]).all()
    assert np.array_equal(np.signbit(back[x != 0]), np.signbit(x[x != 0]))
    assert (back[1, 2] == 0).all()


def test_dequantized_values_quantize_to_themselves() -> None:
    back = from_fp8(*to_fp8(hidden_like(3)))
    assert np.array_equal(from_fp8(*to_fp8(back)), back)  # the scale may drop a binade; the values stay


@pytest.mark.parametrize("seed", range(4))
def test_matches_torch_quantization(seed: int) -> None:
    from hsx.extractor.connector.fp8 import quantize

    x = hidden_like(seed) * np.float32(10.0 ** (seed - 2))  # rows of every magnitude
    codes, scales = quantize(torch.from_numpy(x))
    ours = to_fp8(x)
    assert np.array_equal(codes.numpy(), ours[0]) and np.array_equal(scales.numpy(), ours[1])


@pytest.mark.parametrize("bad", [np.inf, -np.inf, np.nan])
def test_non_finite_values_are_refused_by_position(bad: float) -> None:
    x = hidden_like()
    x[3, 1, 5] = bad
    with pytest.raises(ValueError, match="token 3, layer 1, element 5"):
        to_fp8(x)


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(ValueError, match="float32 \\[tokens, layers, hidden\\]"):
        to_fp8(np.zeros((2, 3), np.float32))
    with pytest.raises(ValueError, match="do not fit together"):
        from_fp8(np.zeros((2, 3, 4), np.uint8), np.ones((3, 2), np.float32))
    with pytest.raises(ValueError, match="do not match shape"):
        widen(b"\0" * 10, (1, 1, 4), DType.FLOAT32)


def test_real_hidden_states_stay_within_the_bound(real_hidden_states: torch.Tensor) -> None:
    from hsx.extractor.connector.fp8 import quantize

    for dtype in DType:
        x = real_hidden_states.to(TORCH_DTYPES[dtype]).float().numpy()
        codes, scales = to_fp8(x)
        torch_codes, torch_scales = quantize(real_hidden_states.to(TORCH_DTYPES[dtype]))
        assert np.array_equal(torch_codes.numpy(), codes) and np.array_equal(torch_scales.numpy(), scales)
        back = from_fp8(codes, scales)
        assert (np.abs(back - x) <= error_bound(x, scales)).all()
        per_layer = np.linalg.norm(back - x, axis=(0, 2)) / np.linalg.norm(x, axis=(0, 2))
        assert (per_layer < 2.0**-4).all()
