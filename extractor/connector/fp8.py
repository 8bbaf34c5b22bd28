"""fp8 (E4M3FN) quantization in torch, on whatever device the rows are on, so the
connector can shrink hidden states before the device-to-host copy. It produces
the same codes and scales, bit for bit, as :func:`hsx.codecs.fp8.to_fp8`,
which documents the scheme and its error bound; only torch is imported."""

from __future__ import annotations

import torch


def quantize(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[tokens, layers, hidden]`` rows (any float dtype) to ``(codes, scales)``:
    uint8 E4M3FN codes of the same shape and float32 ``[tokens, layers]`` scales,
    on the rows' device."""
    if rows.dim() != 3 or not rows.dtype.is_floating_point:
        raise ValueError(f"quantize takes float [tokens, layers, hidden] rows, not {rows.dtype} {tuple(rows.shape)}")
    values = rows.float()
    # The same float32 operations in the same order as hsx.codecs.fp8.to_fp8. Full
    # tensors as divisors keep true division: torch's CUDA kernel turns a scalar
    # divisor into a product with its reciprocal, which rounds differently.
    amax = values.abs().amax(dim=-1)
    scales = (amax / torch.full_like(amax, 448.0)).clamp_(min=2.0**-126)
    codes = (values / scales.unsqueeze(-1)).to(torch.float8_e4m3fn).view(torch.uint8)
    return codes, scales
