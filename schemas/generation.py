"""Generation: the verifier answers the prompt and the hidden states of prompt +
answer are captured in the same pass.

``Generation`` is what a prompt event asks for (sampling parameters, bounds
checked here); ``GenerationRecord`` is what a sample records of how its answer
came to be, for reproducibility.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, ValidationInfo, field_validator

from hsx.schemas.common import NonNegativeInt, PositiveInt, StrictModel, TokenId
from hsx.schemas.limits import limits_of

FinishReason = Literal["stop", "length"]


class Generation(StrictModel):
    """Sampling parameters, as vLLM's ``SamplingParams`` takes them; unset ones
    keep vLLM's defaults. ``temperature`` 0 is greedy decoding."""

    max_tokens: PositiveInt
    """Tokens to generate at most (at most ``PromptLimits.max_generated_tokens``);
    the prompt plus ``max_tokens`` must fit ``--max-model-len``."""
    temperature: Annotated[float, Field(ge=0.0, le=100.0)] = 0.0
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Field(ge=-1, le=1_000_000)] | None = None
    """-1 or 0: no top-k."""
    min_p: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    seed: Annotated[int, Field(ge=0, le=2**63 - 1)] | None = None
    repetition_penalty: Annotated[float, Field(gt=0.0, le=100.0)] | None = None
    stop: Annotated[list[Annotated[str, Field(min_length=1, max_length=256)]], Field(max_length=16)] | None = None
    stop_token_ids: Annotated[list[TokenId], Field(max_length=64)] | None = None
    ignore_eos: bool = False
    turns: Literal["all", "last"] = "all"
    """For chats: regenerate every assistant turn in order, or only the last."""

    @field_validator("max_tokens")
    @classmethod
    def _bounded(cls, value: int, info: ValidationInfo) -> int:
        limit = limits_of(info).max_generated_tokens
        if value > limit:
            raise ValueError(f"max_tokens is {value}, more than the limit of {limit}")
        return value

    def sampling_kwargs(self) -> dict[str, object]:
        """The fields that are ``SamplingParams`` arguments, unset ones left out."""
        return self.model_dump(exclude={"turns"}, exclude_none=True)


class GeneratedTurn(StrictModel):
    """One answer the verifier generated, as a half-open range ``[token_start,
    token_end)`` of the full sequence: the sample's ``token_ids`` followed by
    ``GenerationRecord.final_token_id``."""

    token_start: NonNegativeInt
    token_end: PositiveInt
    finish_reason: FinishReason


class GenerationRecord(StrictModel):
    """How a sample's answers were generated. The final generated token was
    never an input of a forward pass, so it has no hidden state: the sample's
    ``token_ids`` end before it, and it travels here, so a trainer still has the
    last target."""

    params: Generation
    turns: Annotated[list[GeneratedTurn], Field(min_length=1)]
    final_token_id: TokenId
