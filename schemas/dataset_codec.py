"""Dataset codecs as contracts: which codecs a shard may store a sample with
(:class:`DatasetCodec`, recorded in shard metadata and ready events) and the
header of an fp8 sample. The numerics are in :mod:`hsx.codecs.dataset`.

``DatasetCodec`` is not :class:`~hsx.schemas.blocks.Codec`: a block codec says how
one *record on the wire* compresses its bytes (and is chosen per block), a dataset
codec how a *sample at rest* is stored (lossy ones included); ``byteplane-zstd``
names the same compression in both.
"""

from __future__ import annotations

from enum import Enum
from typing import Literal

from pydantic import Field

from hsx.schemas.blocks import Checksum, DType, Segment
from hsx.schemas.common import PositiveInt, StrictModel

FP8_MAGIC = b"HSX8"
"""The first bytes of an fp8 sample: ``FP8_MAGIC | u32 header length | JSON Fp8Header | scales | codes``."""


class DatasetCodec(str, Enum):
    """How a shard stores a sample's hidden states."""

    RAW = "raw"
    BYTEPLANE_ZSTD = "byteplane-zstd"
    FP8 = "fp8"
    FP8_ZSTD = "fp8-zstd"

    @property
    def lossless(self) -> bool:
        """Whether decoding gives back the very bytes that were encoded."""
        return self in (DatasetCodec.RAW, DatasetCodec.BYTEPLANE_ZSTD)


class Fp8Header(StrictModel):
    """The header of an fp8 sample: enough to verify and dequantize it alone."""

    codec_version: Literal[1] = 1
    codec: Literal["fp8", "fp8-zstd"]
    dtype: DType
    """The element type the sample had and decodes back to."""
    shape: tuple[PositiveInt, PositiveInt, PositiveInt]
    scaling: Literal["amax/448"] = "amax/448"
    """One float32 scale per token and layer: its largest magnitude ÷ 448."""
    checksum: Checksum
    """Of the raw scales bytes followed by the raw codes bytes."""
    segments: list[Segment] = Field(min_length=2, max_length=2)
    """The scales (``[tokens, layers]`` little-endian float32), then the codes."""
