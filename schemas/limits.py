"""Upper bounds on what one prompt event may ask for, passed to validation as
context (``context={"limits": limits}``); without one the defaults apply."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson

from pydantic import ValidationInfo


@dataclass(frozen=True)
class PromptLimits:
    """Upper bounds on one prompt event. Every bound keeps one hostile record from
    costing a service unbounded memory or time."""

    max_event_bytes: int = 4 * 1024 * 1024
    max_prompt_chars: int = 1_000_000
    max_token_ids: int = 131_072
    max_messages: int = 1_024
    max_message_chars: int = 1_000_000
    max_metadata_bytes: int = 64 * 1024
    max_metadata_depth: int = 8
    max_template_kwargs_bytes: int = 4 * 1024
    max_image_bytes: int = 2 * 1024 * 1024
    """Decoded bytes of one image (base64 in the event adds a third)."""
    max_images: int = 16
    """Images in one event."""
    max_generated_tokens: int = 8192


DEFAULT_LIMITS = PromptLimits()


def limits_of(info: ValidationInfo) -> PromptLimits:
    """The limits a validation runs under."""
    context = info.context or {}
    limits = context.get("limits", DEFAULT_LIMITS)
    if not isinstance(limits, PromptLimits):
        raise TypeError("validation context 'limits' must be a PromptLimits")
    return limits


def check_json_bounds(field: str, value: dict[str, Any], max_bytes: int, max_depth: int) -> None:
    """``ValueError`` naming ``field`` when ``value`` nests deeper than
    ``max_depth``, is larger than ``max_bytes`` as JSON, or holds what JSON tools
    cannot carry."""
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
