"""E4M3 (``float8_e4m3fn``) hidden states with one scale per token and layer, in
numpy alone: the sink and readers need neither torch nor a GPU to convert.

Quantization of a ``[tokens, layers, hidden]`` array ``x``, all in float32::

    scale[t, l] = max(max_h |x[t, l, h]| / 448, 2**-126)
    code[t, l, h] = round_to_nearest_even_e4m3(x[t, l, h] / scale[t, l])
    x'[t, l, h] = e4m3_value(code) * scale[t, l]

Each row's largest element maps to 448, E4M3FN's largest value, so it survives
almost exactly. That matters because the largest elements are the outlier
channels that dominate a layer's norm. A power-of-two scale (exact, but up to one
binade short of 448) had 1.9-3.7x the relative error per layer on SmolLM2. Every
step is one correctly rounded IEEE operation in a fixed order, so numpy here and
torch (``hsx.extractor.connector.fp8``, on CPU or CUDA) give the same codes and
scales bit for bit; ``bench/gpu_check.py`` checks that on a GPU.

**Error bound.** E4M3 keeps 3 mantissa bits. For a scaled value in the normal
range (``|x| / scale >= 2**-6``) the relative error is at most ``2**-4``, half a
unit in the last place. Below that, E4M3 is subnormal with a fixed step of
``2**-9``, so the absolute error is at most ``2**-10 * scale``. Per element, with
``2**-20`` of slack for the float32 division and product, and ``2**-150`` for a
product that lands among float32's subnormals (an element under ``2**-126``),
where float32's half unit is absolute::

    |x' - x| <= max(2**-4 * |x|, 2**-10 * scale[t, l]) * (1 + 2**-20) + 2**-150

That bound holds for the float32 result of :func:`from_fp8`. Narrowing adds the
narrower type's own half unit: ``max(2**-8 * |x'|, 2**-134)`` for bfloat16 (8
significant bits; the absolute term below ``2**-126``, its subnormals),
``max(2**-11 * |x'|, 2**-25)`` for float16. Non-finite inputs are rejected,
because E4M3FN has no infinities.

The codes are bit patterns of ``torch.float8_e4m3fn`` (sign, 4 exponent bits with
bias 7, 3 mantissa bits). The conversion ports c10's ``fp8e4m3fn_from_fp32_value``.
"""

from __future__ import annotations

import numpy as np

from hsx.schemas.blocks import DType

E4M3_MAX = 448.0
"""The largest finite E4M3FN value: ``1.75 * 2**8``."""
RELATIVE_BOUND = 2.0**-4
"""Worst relative error of a value that is normal after scaling (before the slack)."""
SUBNORMAL_STEP_BOUND = 2.0**-10
"""Worst absolute error, in units of the scale, of a value that is subnormal after scaling."""
FLOAT32_SLACK = 2.0**-20
"""Relative slack for the two float32 roundings (division, product) around E4M3's."""
SUBNORMAL_PRODUCT_SLACK = 2.0**-150
"""Absolute slack for a product that rounds among float32's subnormals (step ``2**-149``)."""
MIN_SCALE = 2.0**-126
"""The scales' floor, float32's smallest normal: an all-zero row still divides."""

_U32 = np.dtype("<u4")


def _table() -> np.ndarray:
    """The float32 value of every one of the 256 E4M3FN codes (0x7F and 0xFF are NaN)."""
    codes = np.arange(256)
    exponent, mantissa = (codes >> 3) & 0xF, (codes & 7).astype(np.float64)
    magnitude = np.where(exponent == 0, mantissa / 8 * 2.0**-6, (1 + mantissa / 8) * 2.0 ** (exponent - 7.0))
    magnitude[(codes & 0x7F) == 0x7F] = np.nan
    return np.where(codes & 0x80, -magnitude, magnitude).astype(np.float32)


E4M3_VALUES = _table()


def widen(raw: np.ndarray | bytes | memoryview, shape: tuple[int, int, int], dtype: DType) -> np.ndarray:
    """The ``[tokens, layers, hidden]`` float32 array of raw little-endian bytes of
    ``dtype``; exact for every dtype (bfloat16 is float32's upper half)."""
    buffer = np.frombuffer(raw, dtype=np.uint8)
    expected = int(np.prod(shape)) * dtype.itemsize
    if buffer.nbytes != expected:
        raise ValueError(f"{buffer.nbytes} raw bytes do not match shape {tuple(shape)} of {dtype.value}")
    if dtype is DType.FLOAT32:
        return buffer.view("<f4").astype(np.float32).reshape(shape)
    if dtype is DType.FLOAT16:
        return buffer.view("<f2").astype(np.float32).reshape(shape)
    return (buffer.view("<u2").astype(_U32) << 16).view(np.float32).reshape(shape)


def narrow(values: np.ndarray, dtype: DType) -> np.ndarray:
    """float32 ``values`` as the raw little-endian bytes (a uint8 array) of
    ``dtype``, rounding to nearest even as torch does."""
    values = np.ascontiguousarray(values, dtype=np.float32)
    if dtype is DType.FLOAT32:
        return values.astype("<f4").view(np.uint8).reshape(-1)
    if dtype is DType.FLOAT16:
        return values.astype("<f2").view(np.uint8).reshape(-1)
    bits = values.view(np.uint32)
    # In place on one temporary: this runs on every fp8 sample a reader decodes.
    wide = bits >> 16
    wide &= 1
    wide += 0x7FFF
    wide += bits
    wide >>= 16
    rounded = wide.astype("<u2")
    if ((rounded & 0x7F80) == 0x7F80).any():  # the carry above could turn a NaN into an infinity
        rounded[np.isnan(values)] = 0x7FC0
    return rounded.view(np.uint8).reshape(-1)


def scales_for(values: np.ndarray) -> np.ndarray:
    """The ``[tokens, layers]`` float32 scales of float32 ``values``: ``amax / 448``,
    floored at float32's smallest normal, so that an all-zero row still divides."""
    amax = np.abs(values).max(axis=-1)
    return np.maximum(amax / np.float32(E4M3_MAX), np.float32(MIN_SCALE))


def to_fp8(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Quantize float32 ``[tokens, layers, hidden]`` ``values`` (from :func:`widen`)
    to ``(codes, scales)``: uint8 E4M3FN codes of the same shape and float32
    ``[tokens, layers]`` scales. Raises ``ValueError`` on non-finite values."""
    values = np.asarray(values)
    if values.ndim != 3 or values.dtype != np.float32:
        raise ValueError(f"to_fp8 takes a float32 [tokens, layers, hidden] array, not {values.dtype} {values.shape}")
    finite = np.isfinite(values)
    if not finite.all():
        t, layer, h = np.argwhere(~finite)[0]
        raise ValueError(f"fp8 cannot hold the non-finite value {values[t, layer, h]} at token {t}, layer "
                         f"{layer}, element {h} (E4M3FN has no infinities)")
    scales = scales_for(values)
    return e4m3_codes(values / scales[..., None]), scales


def e4m3_codes(scaled: np.ndarray) -> np.ndarray:
    """Round float32 values to E4M3FN codes, nearest even (c10's routine, vectorized).
    Magnitudes of 464 and above, infinities included, saturate to 448 and NaN is
    0x7F, as torch 2.13 converts; scaled hidden states never get there."""
    bits = np.ascontiguousarray(scaled, dtype=np.float32).view(np.uint32)
    sign = (bits >> 24) & 0x80
    magnitude = bits & 0x7FFFFFFF
    # Below 2**-6 (E4M3's smallest normal): add 2**14 in float32 arithmetic, which
    # rounds the value to a multiple of 2**-9 and leaves it in the low bits.
    subnormal = ((magnitude.view(np.float32) + np.float32(2.0**14)).view(np.uint32) - (141 << 23))
    # Normal: rebias the exponent (127 -> 7) and round the 20 dropped bits to even.
    normal = (magnitude - (120 << 23) + 0x7FFFF + ((magnitude >> 20) & 1)) >> 20
    codes = np.where(magnitude < (121 << 23), subnormal, normal)
    codes = np.where(magnitude >= (1087 << 20) - (1 << 19), 0x7E, codes)  # 464.0 and up
    codes = np.where(magnitude > 0x7F800000, 0x7F, codes)
    return (codes | sign).astype(np.uint8)


def from_fp8(codes: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """Dequantize ``(codes, scales)`` to float32 ``[tokens, layers, hidden]``."""
    codes, scales = np.asarray(codes), np.asarray(scales)
    if codes.dtype != np.uint8 or codes.ndim != 3 or scales.shape != codes.shape[:2]:
        raise ValueError(f"fp8 codes {codes.dtype} {codes.shape} and scales {scales.shape} do not fit together")
    values = np.take(E4M3_VALUES, codes)
    values *= scales.astype(np.float32)[..., None]
    return values


def error_bound(values: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """The documented per-element bound on ``|x' - x|`` for float32 ``values`` and
    the float32 result of :func:`from_fp8`, in float64: exact, where float32 would
    round the bound itself (down, too) for rows among its subnormals."""
    values, scales = np.asarray(values, dtype=np.float64), np.asarray(scales, dtype=np.float64)
    bound = np.maximum(RELATIVE_BOUND * np.abs(values), SUBNORMAL_STEP_BOUND * scales[..., None])
    return bound * (1 + FLOAT32_SLACK) + SUBNORMAL_PRODUCT_SLACK
