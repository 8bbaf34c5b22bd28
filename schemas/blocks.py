"""Records on ``hidden_states.blocks``: binary block records carrying compressed
slices of a request's hidden states, then one JSON manifest per request attempt
(:mod:`hsx.schemas.manifest`). By reference (``hsx extract --payload-store``),
the block records' values go back to back into one staged object instead, and
the manifest alone goes to Kafka, saying where each block is in it.

Every record of one request is keyed by its ``request_id`` (so all land in one
partition, in order) and carries :class:`BlockRecordHeaders` as Kafka headers.
A block's value is ``MAGIC | u32 little-endian header length | JSON BlockHeader |
payload``; :mod:`hsx.codecs.block` encodes and decodes it.
"""

from __future__ import annotations

import re
import struct
from enum import Enum
from typing import Annotated, Literal

from pydantic import Field, model_validator

from hsx.schemas.common import SCHEMA_VERSION, NonNegativeInt, PositiveInt, StrictModel

AttemptId = Annotated[str, Field(pattern=r"^[0-9a-f]{32}$")]
"""One extraction attempt of one request (uuid4 hex). A retried request gets a new
attempt id; the sink keeps exactly one attempt per request_id."""
Checksum = Annotated[str, Field(pattern=r"^crc32:[0-9a-f]{8}$")]

MAGIC = b"HSXB"
"""The first bytes of every block record's value."""
FRAME_PREFIX = struct.Struct("<4sI")
"""The magic, then the JSON header's length (u32, little-endian)."""
MAX_HEADER_BYTES = 64 * 1024
"""A longer header is corrupt (or hostile): decoders refuse it before parsing."""


class Codec(str, Enum):
    """How a block record's raw bytes are compressed on the wire (not how a sample
    is stored at rest: :class:`hsx.schemas.dataset_codec.DatasetCodec`)."""

    BYTEPLANE_ZSTD = "byteplane-zstd"
    ZSTD = "zstd"
    NONE = "none"


class DType(str, Enum):
    """Element types a hidden-state block may hold."""

    FLOAT32 = "float32"
    BFLOAT16 = "bfloat16"
    FLOAT16 = "float16"

    @property
    def itemsize(self) -> int:
        return 4 if self is DType.FLOAT32 else 2


Quantization = Literal["fp8"]
"""How a block of codec version 2 quantized its rows. ``fp8``: E4M3FN codes with
one float32 scale per token and layer, ``amax / 448`` (:mod:`hsx.codecs.fp8`, which
documents the error bound)."""


class RecordKind(str, Enum):
    BLOCK = "block"
    MANIFEST = "manifest"


class Segment(StrictModel):
    """One stretch of a block's payload."""

    encoding: Literal["zstd", "raw"]
    """``raw`` where compression would not have saved space (e.g. the mantissa
    plane of bfloat16), so decoding skips it."""
    nbytes: NonNegativeInt


class BlockHeader(StrictModel):
    """Self-describing header at the front of every block record value: enough to
    decode and verify the block without its manifest."""

    codec_version: Literal[1, 2] = 1
    """1: the payload holds the rows' bytes of ``dtype``. 2: it holds them
    quantized as ``quantization`` says. Version 1 records are written exactly as
    before version 2 existed, so sinks of either age read them."""
    codec: Codec
    dtype: DType
    """The rows' element type; for a quantized block, the type they came from and
    dequantize to (the model's)."""
    shape: tuple[PositiveInt, PositiveInt, PositiveInt]
    """``[num_tokens_in_block, num_layers, hidden_size]``."""
    token_start: NonNegativeInt
    token_end: PositiveInt
    checksum: Checksum
    """Of the raw (uncompressed) bytes, so decoding is verified end to end. For a
    quantized block: of what was sent, the scales' bytes then the codes' bytes."""
    segments: list[Segment] = Field(min_length=1)
    """The payload's segments in order: one per byte plane for ``byteplane-zstd``,
    a single one otherwise; for ``fp8``, the scales (``[tokens, layers]``
    little-endian float32) then the codes (``[tokens, layers, hidden]`` uint8),
    each zstd-compressed unless ``codec`` is ``none`` (one-byte codes have one
    byte plane, so ``byteplane-zstd`` and ``zstd`` are the same there)."""
    quantization: Quantization | None = None
    """Set exactly when ``codec_version`` is 2."""
    payload_checksum: Checksum | None = None
    """Of the payload as it travels and is stored (every byte after the header),
    so a sink that stores the record as it came verifies it without decoding it;
    decoders check it too, before they decompress. Absent in records written
    before it existed: those are verified by decoding, against ``checksum``."""

    @property
    def part_nbytes(self) -> list[int]:
        """The raw size of each part the checksum covers, in order."""
        tokens, layers, hidden = self.shape
        if self.quantization == "fp8":
            return [tokens * layers * 4, tokens * layers * hidden]
        return [tokens * layers * hidden * self.dtype.itemsize]

    @property
    def raw_nbytes(self) -> int:
        return sum(self.part_nbytes)

    @model_validator(mode="after")
    def _token_range_matches_shape(self) -> BlockHeader:
        if self.token_end - self.token_start != self.shape[0]:
            raise ValueError("token_end - token_start must equal shape[0]")
        if (self.codec_version == 2) != (self.quantization is not None):
            raise ValueError("quantization is set on codec version 2 blocks and only there")
        return self


_HEADER_INT = re.compile(r"^[0-9]{1,10}$")


class BlockRecordHeaders(StrictModel):
    """Kafka headers on every ``hidden_states.blocks`` record, so a consumer can
    route a record without decoding its value."""

    kind: RecordKind
    attempt_id: AttemptId
    block_index: NonNegativeInt | None = None
    """Set on block records only."""
    codec: Codec | None = None
    """Set on block records only."""
    schema_version: Literal[1] = SCHEMA_VERSION

    @model_validator(mode="after")
    def _block_fields(self) -> BlockRecordHeaders:
        is_block = self.kind is RecordKind.BLOCK
        if is_block != (self.block_index is not None) or is_block != (self.codec is not None):
            raise ValueError("block_index and codec are set on block records and only there")
        return self

    def to_kafka(self) -> list[tuple[str, bytes]]:
        """As a Kafka header list (UTF-8 values)."""
        pairs = [
            ("kind", self.kind.value),
            ("attempt-id", self.attempt_id),
            ("schema-version", str(self.schema_version)),
        ]
        if self.block_index is not None and self.codec is not None:
            pairs += [("block-index", str(self.block_index)), ("codec", self.codec.value)]
        return [(k, v.encode()) for k, v in pairs]

    @classmethod
    def from_kafka(cls, headers: list[tuple[str, bytes | None]] | None) -> BlockRecordHeaders:
        """Parse Kafka headers; raises ``ValueError`` (a ``ValidationError``) naming
        the bad header."""
        raw = {k: (v or b"").decode("utf-8", "replace") for k, v in headers or []}
        block_index = raw.get("block-index")
        schema_version = raw.get("schema-version", "")
        return cls.model_validate(
            {
                "kind": raw.get("kind"),
                "attempt_id": raw.get("attempt-id"),
                "block_index": int(block_index) if block_index and _HEADER_INT.match(block_index) else block_index,
                "codec": raw.get("codec"),
                "schema_version": int(schema_version) if _HEADER_INT.match(schema_version) else schema_version,
            },
            strict=False,
        )
