"""fp8 (E4M3FN) quantization in torch, on whatever device the rows are on, so the
connector can shrink hidden states before the device-to-host copy. It produces
the same codes and power-of-two scales, bit for bit, as :func:`schemas.fp8.to_fp8`,
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
    mantissa, exponent = torch.frexp(values.abs().amax(dim=-1))
    # The scale is built from its bits rather than with ldexp/pow, whose results are
    # not guaranteed exact on every device; see schemas.fp8.scales_for.
    k = torch.where(mantissa <= 0.875, exponent - 9, exponent - 8).clamp_(min=-126)
    scales = ((k + 127) << 23).to(torch.int32).view(torch.float32)
    inverse = ((127 - k) << 23).to(torch.int32).view(torch.float32)
    codes = (values * inverse.unsqueeze(-1)).to(torch.float8_e4m3fn).view(torch.uint8)
    return codes, scales
