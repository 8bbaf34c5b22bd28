"""A chat message of a prompt event (``PromptEvent.messages``): text, or
OpenAI-style content parts (text and, in user turns, images as data URIs)."""

from __future__ import annotations

import base64
import binascii
from typing import Annotated, Any, Literal

from pydantic import Field, TypeAdapter, ValidationError, ValidationInfo, field_validator, model_validator

from hsx.schemas.common import StrictModel
from hsx.schemas.limits import limits_of as _limits

Role = Literal["system", "user", "assistant", "tool"]

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
