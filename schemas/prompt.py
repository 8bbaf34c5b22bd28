"""The prompt event: what users publish to the ``prompts`` topic.

``PromptEvent.model_validate_json(raw)`` is the one way to parse one. Size limits
come from a :class:`PromptLimits` passed as validation context
(``context={"limits": limits}``); without one the defaults apply.
"""

from __future__ import annotations

import base64
import binascii
from typing import Annotated, Any, Literal

import orjson
from pydantic import (
    Field,
    JsonValue,
    TypeAdapter,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_core import InitErrorDetails, PydanticCustomError

from hsx.schemas.common import SCHEMA_VERSION, Capture, RequestId, StrictModel, TokenId
from hsx.schemas.generation import Generation
from hsx.schemas.limits import DEFAULT_LIMITS, limits_of as _limits

Role = Literal["system", "user", "assistant", "tool"]
PromptKind = Literal["prompt", "token_ids", "messages"]

RESERVED_TEMPLATE_KWARGS = frozenset({
    "messages", "conversation", "add_generation_prompt", "continue_final_message", "tools", "documents",
    "chat_template", "tokenize", "padding", "truncation", "max_length", "return_tensors", "return_dict",
    "return_assistant_tokens_mask", "tokenizer_kwargs",
})
"""Names ``chat_template_kwargs`` may not use: transformers' ``apply_chat_template``
takes them as its own arguments, and the extractor sets them itself."""


def _check_json_bounds(field: str, value: dict[str, Any], max_bytes: int, max_depth: int) -> None:
    if _depth(value) > max_depth:
        raise ValueError(f"{field} nested deeper than {max_depth} levels")
    try:
        size = len(orjson.dumps(value))
    except orjson.JSONEncodeError as exc:
        # Python's JSON parser (pydantic's) reads integers of any size; orjson, Kafka's
        # consumers and the ready event cannot carry one beyond 64 bits.
        raise ValueError(f"{field} holds a value JSON tools cannot carry: {exc}") from None
    if size > max_bytes:
        raise ValueError(f"{field} is {size} bytes as JSON, more than {max_bytes}")


def _depth(value: Any) -> int:
    if isinstance(value, dict):
        return 1 + max((_depth(v) for v in value.values()), default=0)
    if isinstance(value, list):
        return 1 + max((_depth(v) for v in value), default=0)
    return 0


IMAGE_MEDIA_TYPES = {"image/png": b"\x89PNG\r\n\x1a\n", "image/jpeg": b"\xff\xd8\xff"}
"""The image formats a prompt may embed, with the bytes each file starts with."""


class TextPart(StrictModel):
    """A piece of a message's text (OpenAI's content part ``{"type": "text"}``)."""

    type: Literal["text"]
    text: str


class ImageUrl(StrictModel):
    url: str
    """``data:image/png;base64,...`` or ``data:image/jpeg;base64,...``: the image
    itself. Remote URLs and file paths are refused: hsx fetches nothing."""
    detail: Literal["auto", "low", "high"] | None = None
    """Accepted for OpenAI compatibility; the model's processor decides the resolution."""

    @field_validator("url")
    @classmethod
    def _embedded_image(cls, value: str, info: ValidationInfo) -> str:
        image_bytes(value, _limits(info).max_image_bytes)
        return value


class ImagePart(StrictModel):
    """An image in a message (OpenAI's content part ``{"type": "image_url"}``)."""

    type: Literal["image_url"]
    image_url: ImageUrl


ContentPart = Annotated[TextPart | ImagePart, Field(discriminator="type")]
_PARTS: TypeAdapter[list[TextPart | ImagePart]] = TypeAdapter(list[ContentPart])


def image_bytes(url: str, limit: int) -> bytes:
    """The image a data URI holds; ``ValueError`` saying which rule it breaks."""
    if not url.startswith("data:"):
        if url.startswith(("http://", "https://", "ftp://", "s3://", "gs://")):
            raise ValueError("remote image URLs are refused (hsx fetches nothing): embed the image as "
                             "data:image/png;base64,...")
        raise ValueError("file paths and other URLs are refused: embed the image as data:image/png;base64,...")
    header, comma, data = url.partition(",")
    media_type, _, encoding = header[len("data:"):].partition(";")
    if not comma or encoding != "base64":
        raise ValueError("an image data URI must be base64: data:image/png;base64,...")
    if media_type not in IMAGE_MEDIA_TYPES:
        raise ValueError(f"image type {media_type[:64]!r} is not one of {', '.join(IMAGE_MEDIA_TYPES)}")
    if len(data) > 4 * ((limit + 2) // 3):  # before decoding: an oversized image costs no decode
        raise ValueError(f"image is more than the limit of {limit} bytes")
    try:
        raw = base64.b64decode(data, validate=True)
    except binascii.Error as exc:
        raise ValueError(f"image data is not valid base64: {exc}") from None
    if len(raw) > limit:
        raise ValueError(f"image is {len(raw)} bytes, more than the limit of {limit}")
    if not raw.startswith(IMAGE_MEDIA_TYPES[media_type]):
        raise ValueError(f"image data is not a {media_type.split('/')[1].upper()} file")
    return raw


class Message(StrictModel):
    """One chat turn. Content is text, or OpenAI-style content parts: text and,
    in user turns, images as data URIs. Content may be empty (an empty system
    prompt is common); the chat as a whole must say something."""

    role: Role
    content: str | list[ContentPart]

    @field_validator("content", mode="before")
    @classmethod
    def _parts(cls, value: Any, info: ValidationInfo) -> Any:
        """Content parts validated here, so an error reads ``part 1.image_url.url: ...``
        rather than through every member of the union."""
        if not isinstance(value, list):
            return value  # a string, or the wrong type: the union says which
        try:
            return _PARTS.validate_python(value, context=info.context)
        except ValidationError as exc:
            error = exc.errors(include_url=False)[0]
            index, *rest = error["loc"]
            where = ".".join(str(p) for p in [index, *rest[1:]])  # rest[0]: the part's type, as the union tags it
            raise ValueError(f"part {where}: {error['msg'].removeprefix('Value error, ')}") from None

    @field_validator("content")
    @classmethod
    def _bounded(cls, value: str | list[TextPart | ImagePart], info: ValidationInfo) -> str | list[TextPart | ImagePart]:
        limit = _limits(info).max_message_chars
        text = value if isinstance(value, str) else "".join(p.text for p in value if isinstance(p, TextPart))
        if len(text) > limit:
            raise ValueError(f"message content longer than {limit} characters")
        return value

    @model_validator(mode="after")
    def _images_from_users(self) -> Message:
        if self.images and self.role != "user":
            raise ValueError(f"images are allowed in user messages only, not in a {self.role} message")
        return self

    @property
    def text(self) -> str:
        """The text, parts joined by newlines (as vLLM's OpenAI server joins them)."""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(p.text for p in self.content if isinstance(p, TextPart))

    @property
    def images(self) -> list[tuple[int, ImagePart]]:
        """The image parts, each with its index among the parts."""
        return [] if isinstance(self.content, str) else [
            (j, part) for j, part in enumerate(self.content) if isinstance(part, ImagePart)]


class PromptEvent(StrictModel):
    """A request for hidden states: exactly one of ``prompt`` (text),
    ``token_ids`` (already tokenized) or ``messages`` (a chat, rendered with the
    model's chat template). ``metadata`` is passed through untouched to the
    ``hidden_states.ready`` event."""

    schema_version: Literal[1] = SCHEMA_VERSION
    request_id: RequestId
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
            _check_json_bounds("metadata", value, limits.max_metadata_bytes, limits.max_metadata_depth)
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
        _check_json_bounds("chat_template_kwargs", value, limits.max_template_kwargs_bytes, limits.max_metadata_depth)
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
