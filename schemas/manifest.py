"""The manifest: the last record of a request attempt on ``hidden_states.blocks``,
which describes and vouches for its blocks (:class:`BlockRef`); by reference it
alone goes to Kafka and says where each block is in the attempt's staged object
(:class:`PayloadRef`, at :func:`staged_key`)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, JsonValue, field_validator, model_validator

from hsx.schemas.blocks import AttemptId, Checksum, Codec, DType, Quantization
from hsx.schemas.common import (
    SCHEMA_VERSION,
    SOURCE_ID_CHARS,
    Capture,
    NonNegativeInt,
    PositiveInt,
    RequestId,
    StrictModel,
    TokenId,
)
from hsx.schemas.drafts import Speculation
from hsx.schemas.generation import GenerationRecord


class BlockRef(StrictModel):
    """What the manifest promises about one block."""

    index: NonNegativeInt
    token_start: NonNegativeInt
    token_end: PositiveInt
    checksum: Checksum
    compressed_nbytes: NonNegativeInt
    """The size of the block record's value (header included)."""
    offset: NonNegativeInt | None = None
    """Where that value starts in the staged object; set exactly when the manifest
    has a ``payload``."""


STAGED_SUFFIX = ".blocks"


def staged_key(request_id: str, attempt_id: str) -> str:
    """The staged object of one attempt, relative to the payload store. Derived,
    not chosen: a sink reads only the key it derives itself, so a forged manifest
    cannot point it at another object or file. Flat (no folder per request), so a
    store directory holds only the objects in flight, and deleting leaves nothing."""
    return f"{request_id}.{attempt_id}{STAGED_SUFFIX}"


class PayloadRef(StrictModel):
    """The staged object holding a by-reference attempt's blocks: their record
    values back to back, in block order, exactly as they would have gone to Kafka."""

    key: Annotated[str, Field(min_length=1, max_length=512)]
    """Relative to the payload store both services are given (``--payload-store``);
    always :func:`staged_key` of the manifest's request and attempt (a sink dead-letters
    any other as ``payload_forbidden``). Never a URL or a credential."""
    nbytes: NonNegativeInt
    """The object's size: the blocks' ``compressed_nbytes`` summed."""


class SourceRef(StrictModel):
    """Where the prompt came from: lets anyone trace a sample back to its event."""

    topic: str
    partition: NonNegativeInt
    offset: NonNegativeInt
    request_id: str | None = Field(default=None, max_length=SOURCE_ID_CHARS)
    """The event's own id when the sample's is its ``sample_id`` (an id no
    path or tensor name could take, e.g. ``HumanEval/0``)."""


SERVED_REQUEST_ID_CHARS = 1024


class ServedRef(StrictModel):
    """Where a served request came from: the vLLM server that answered it and
    that server's id for it, which embeds a client's ``X-Request-Id`` (kept as
    the client sent it, cut to :data:`SERVED_REQUEST_ID_CHARS`; the sample's own
    ``request_id`` is the safe name the server gave it)."""

    server: str = Field(min_length=1, max_length=128)
    request_id: str = Field(max_length=SERVED_REQUEST_ID_CHARS)


class Manifest(StrictModel):
    """The last record of a request attempt: describes and vouches for its blocks.
    A sample is complete when every block it lists has arrived with the same
    attempt id and checksum."""

    schema_version: Literal[1] = SCHEMA_VERSION
    request_id: RequestId
    attempt_id: AttemptId
    model: str
    layer_ids: list[NonNegativeInt] = Field(min_length=1)
    dtype: DType
    hidden_size: PositiveInt
    num_tokens: PositiveInt
    token_ids: list[TokenId]
    loss_mask_spans: list[tuple[NonNegativeInt, PositiveInt]] | None = None
    """Half-open token ranges ``[start, end)`` the trainer learns from (the
    assistant turns of a chat); ``None`` when the prompt was not a chat."""
    codec: Codec
    quantization: Quantization | None = None
    """Set when every block is quantized so (``hsx extract --wire-dtype fp8``);
    ``dtype`` stays the model's, which the blocks dequantize to."""
    blocks: list[BlockRef] = Field(min_length=1)
    metadata: dict[str, JsonValue] | None = None
    source: SourceRef | ServedRef
    generation: GenerationRecord | None = None
    """How the answer in ``token_ids`` was generated, when the prompt asked for one."""
    capture: Capture = "all"
    """``last``: the blocks hold only the final token's hidden states (one row)."""
    payload: PayloadRef | None = None
    """By reference: the staged object holding the blocks, which then never
    appear as block records. Absent for inline attempts."""
    speculation: Speculation | None = None
    """A request served with a draft: which draft, and what of it was accepted."""

    def by_reference(self) -> Manifest:
        """This manifest for blocks staged back to back, in order, in the object
        at :func:`staged_key` (what ``hsx extract --payload-store`` uploads)."""
        blocks, offset = [], 0
        for block in self.blocks:
            blocks.append(block.model_copy(update={"offset": offset}))
            offset += block.compressed_nbytes
        return self.model_validate({**self.model_dump(), "blocks": [b.model_dump() for b in blocks],
                                    "payload": {"key": staged_key(self.request_id, self.attempt_id), "nbytes": offset}})

    @property
    def first_captured(self) -> int:
        """The position of the first token whose hidden states the blocks hold."""
        return self.num_tokens - 1 if self.capture == "last" else 0

    @property
    def captured_tokens(self) -> int:
        """Rows of hidden states: ``num_tokens``, or 1 for ``capture: last``."""
        return self.num_tokens - self.first_captured

    @field_validator("layer_ids")
    @classmethod
    def _unique_layers(cls, value: list[int]) -> list[int]:
        if len(set(value)) != len(value):
            raise ValueError("layer_ids must be unique")
        return value

    @model_validator(mode="after")
    def _consistent(self) -> Manifest:
        if len(self.token_ids) != self.num_tokens:
            raise ValueError("len(token_ids) must equal num_tokens")
        expected_start = self.first_captured
        for i, block in enumerate(self.blocks):
            if block.index != i or block.token_start != expected_start or block.token_end <= block.token_start:
                raise ValueError(f"blocks must be numbered 0.. and tile the tokens contiguously (block {i})")
            expected_start = block.token_end
        if expected_start != self.num_tokens:
            raise ValueError("blocks must cover exactly " + ("the final token" if self.capture == "last"
                                                             else "num_tokens tokens"))
        self._check_offsets()
        for start, end in self.loss_mask_spans or []:
            if not start < end <= self.num_tokens:
                raise ValueError(f"loss mask span [{start}, {end}) outside [0, {self.num_tokens})")
        for turn in self.generation.turns if self.generation else []:
            if not turn.token_start < turn.token_end <= self.num_tokens + 1:  # + the final token
                raise ValueError(f"generated turn [{turn.token_start}, {turn.token_end}) outside the sequence")
        return self

    def _check_offsets(self) -> None:
        """By reference, the blocks tile the staged object from its first byte to its last."""
        if self.payload is None:
            if any(block.offset is not None for block in self.blocks):
                raise ValueError("block offsets are set on by-reference manifests (with a payload) only")
            return
        position = 0
        for block in self.blocks:
            if block.offset != position:
                raise ValueError(f"block {block.index} must start at byte {position} of the payload")
            position += block.compressed_nbytes
        if position != self.payload.nbytes:
            raise ValueError(f"the blocks hold {position} bytes, the payload {self.payload.nbytes}")
