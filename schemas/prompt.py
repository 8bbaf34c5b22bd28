"""The prompt event: what users publish to the ``prompts`` topic.

``PromptEvent.model_validate_json(raw)`` is the one way to parse one. Size limits
come from a :class:`PromptLimits` passed as validation context
(``context={"limits": limits}``); without one the defaults apply.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import JsonValue, ValidationError, ValidationInfo, field_validator, model_validator
from pydantic_core import InitErrorDetails, PydanticCustomError

from hsx.schemas.common import SCHEMA_VERSION, Capture, SourceRequestId, StrictModel, TokenId
from hsx.schemas.generation import Generation
from hsx.schemas.limits import DEFAULT_LIMITS, check_json_bounds, limits_of as _limits
from hsx.schemas.messages import ImagePart, Message

PromptKind = Literal["prompt", "token_ids", "messages"]

RESERVED_TEMPLATE_KWARGS = frozenset({
    "messages", "conversation", "add_generation_prompt", "continue_final_message", "tools", "documents",
    "chat_template", "tokenize", "padding", "truncation", "max_length", "return_tensors", "return_dict",
    "return_assistant_tokens_mask", "tokenizer_kwargs",
})
"""Names ``chat_template_kwargs`` may not use: transformers' ``apply_chat_template``
takes them as its own arguments, and the extractor sets them itself."""


class PromptEvent(StrictModel):
    """A request for hidden states: exactly one of ``prompt`` (text),
    ``token_ids`` (already tokenized) or ``messages`` (a chat, rendered with the
    model's chat template). ``metadata`` is passed through untouched to the
    ``hidden_states.ready`` event."""

    schema_version: Literal[1] = SCHEMA_VERSION
    request_id: SourceRequestId
    """Any id (``HumanEval/0``); the sample's is its :func:`~hsx.schemas.common.sample_id`."""
    prompt: str | None = None
    token_ids: list[TokenId] | None = None
    messages: list[Message] | None = None
    metadata: dict[str, JsonValue] | None = None
    generation: Generation | None = None
    """Let the verifier answer, and capture prompt + answer (see :mod:`hsx.schemas.generation`)."""
    capture: Capture | None = None
    """``last``: store only the final input token's hidden states, ``[1, L, H]``;
    unset or ``all``: every input token's."""
    chat_template_kwargs: dict[str, JsonValue] | None = None
    """Variables for the model's chat template, with ``messages`` only: e.g.
    ``{"enable_thinking": false}`` for a Qwen3-style reasoning model."""

    @classmethod
    def model_validate_json(  # type: ignore[override]
        cls, json_data: str | bytes | bytearray, **kwargs: Any
    ) -> PromptEvent:
        """Parse and validate one raw event; the byte size is checked before parsing
        so an oversized record never costs a full parse."""
        limits = (kwargs.get("context") or {}).get("limits", DEFAULT_LIMITS)
        if len(json_data) > limits.max_event_bytes:
            raise ValidationError.from_exception_data(
                cls.__name__,
                [
                    InitErrorDetails(
                        type=PydanticCustomError(
                            "event_too_large",
                            "event is {size} bytes, more than the limit of {limit}",
                            {"size": len(json_data), "limit": limits.max_event_bytes},
                        ),
                        loc=(),
                        input="<raw event>",
                    )
                ],
            )
        return super().model_validate_json(json_data, **kwargs)

    @field_validator("prompt")
    @classmethod
    def _prompt_rule(cls, value: str | None, info: ValidationInfo) -> str | None:
        if value is None:
            return value
        if not value.strip():
            raise ValueError("prompt must not be empty or only whitespace")
        limit = _limits(info).max_prompt_chars
        if len(value) > limit:
            raise ValueError(f"prompt longer than {limit} characters")
        return value

    @field_validator("token_ids")
    @classmethod
    def _token_ids_rule(cls, value: list[int] | None, info: ValidationInfo) -> list[int] | None:
        if value is None:
            return value
        if not value:
            raise ValueError("token_ids must not be empty")
        limit = _limits(info).max_token_ids
        if len(value) > limit:
            raise ValueError(f"more than {limit} token ids")
        return value

    @field_validator("messages")
    @classmethod
    def _messages_rule(
        cls, value: list[Message] | None, info: ValidationInfo
    ) -> list[Message] | None:
        if value is None:
            return value
        if not value:
            raise ValueError("messages must not be empty")
        limits = _limits(info)
        if len(value) > limits.max_messages:
            raise ValueError(f"more than {limits.max_messages} messages")
        images_per_message = [len(m.images) for m in value]
        if not any(m.text.strip() or n for m, n in zip(value, images_per_message)):
            raise ValueError("every message content is empty")
        images = sum(images_per_message)
        if images > limits.max_images:
            raise ValueError(f"{images} images, more than {limits.max_images}")
        return value

    @field_validator("metadata")
    @classmethod
    def _metadata_rule(
        cls, value: dict[str, Any] | None, info: ValidationInfo
    ) -> dict[str, Any] | None:
        if value is not None:
            limits = _limits(info)
            check_json_bounds("metadata", value, limits.max_metadata_bytes, limits.max_metadata_depth)
        return value

    @field_validator("chat_template_kwargs")
    @classmethod
    def _template_kwargs_rule(
        cls, value: dict[str, Any] | None, info: ValidationInfo
    ) -> dict[str, Any] | None:
        if value is None:
            return value
        for name in value:
            if not name.isidentifier():
                raise ValueError(f"chat_template_kwargs name {name[:64]!r} is not an identifier")
            if name in RESERVED_TEMPLATE_KWARGS:
                raise ValueError(f"chat_template_kwargs may not set {name!r}: hsx sets it")
        limits = _limits(info)
        check_json_bounds("chat_template_kwargs", value, limits.max_template_kwargs_bytes, limits.max_metadata_depth)
        return value

    @model_validator(mode="after")
    def _exactly_one_input(self) -> PromptEvent:
        given = [name for name in ("prompt", "token_ids", "messages") if getattr(self, name) is not None]
        if len(given) != 1:
            got = ", ".join(given) if given else "none"
            raise ValueError(
                f"exactly one of 'prompt', 'token_ids', 'messages' must be set (got: {got})"
            )
        if self.chat_template_kwargs is not None and self.messages is None:
            raise ValueError("chat_template_kwargs apply to 'messages' only: a chat template renders them")
        return self

    @property
    def images(self) -> list[tuple[int, int, ImagePart]]:
        """Every image of the chat as (message index, part index, part)."""
        return [(i, j, part) for i, m in enumerate(self.messages or []) for j, part in m.images]

    @property
    def kind(self) -> PromptKind:
        """Which of the three input forms this event uses."""
        if self.prompt is not None:
            return "prompt"
        if self.token_ids is not None:
            return "token_ids"
        return "messages"
