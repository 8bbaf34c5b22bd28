"""The one mapping between the wire's element types (``hsx.schemas.DType``) and torch's.

It lives here rather than in ``hsx.schemas`` because ``hsx.schemas`` stays free of torch:
lightweight clients (producers, trainers' event readers) import the contracts
without pulling in a tensor library. Only torch users import this module.
"""

from __future__ import annotations

import torch

from hsx.schemas import DType

TORCH_DTYPES: dict[DType, torch.dtype] = {
    DType.FLOAT32: torch.float32,
    DType.BFLOAT16: torch.bfloat16,
    DType.FLOAT16: torch.float16,
}
"""The torch dtype that holds a wire dtype's elements."""

WIRE_DTYPES: dict[torch.dtype, DType] = {torch_dtype: dtype for dtype, torch_dtype in TORCH_DTYPES.items()}
"""The wire dtype of a torch tensor; torch dtypes the wire cannot carry are absent."""
