"""Validate input lines and publish them as prompt events."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Set
from dataclasses import dataclass
from enum import Enum
from typing import Any

import orjson
from pydantic import ValidationError

from hsx.producer.sources import DatasetFormat, MappingError, SourceLine, to_event_dict
from hsx.runtime.errors import InvalidInput
from hsx.runtime.kafka import RecordProducer
from hsx.runtime.kafka.dead_letters import DeadLetters
from hsx.schemas import (
    DEFAULT_LIMITS,
    ErrorClass,
    Generation,
    PromptEvent,
    PromptLimits,
    Topics,
    format_validation_error,
    sample_id,
)

log = logging.getLogger(__name__)


class InvalidPolicy(str, Enum):
    """What to do with a line that is not a valid prompt event."""

    SKIP = "skip"
    """Report it and go on."""
    FAIL = "fail"
    """Report it and stop (records already sent stay sent)."""
    DLQ = "dlq"
    """Report it and publish the original line to the prompts DLQ with the reason."""


class InvalidLine(InvalidInput):
    """A line that cannot become a prompt event, with a rule name and a reason."""

    def __init__(self, line: SourceLine, error_class: ErrorClass, reason: str) -> None:
        super().__init__(error_class, reason)
        self.line = line

    def __str__(self) -> str:
        return f"{self.line.source}:{self.line.line_no}: {self.reason}"


@dataclass(frozen=True)
class Mapping:
    """How input lines map onto prompt events (see :mod:`hsx.producer.sources`)."""

    fmt: DatasetFormat = DatasetFormat.EVENT
    text_field: str = "text"
    id_field: str | None = None
    metadata_fields: tuple[str, ...] = ()
    generation: Generation | None = None
    """Attached to every event that does not ask for a generation of its own."""
    chat_template_kwargs: dict[str, Any] | None = None
    """Attached to every chat that has none of its own."""


@dataclass
class PublishSummary:
    """What became of the lines of one :meth:`Publisher.publish`."""

    sent: int = 0
    invalid: int = 0
    dead_lettered: int = 0
    skipped: int = 0
    """Valid events not sent because their request id was in ``skip_ids``."""
    bytes_sent: int = 0
    seconds: float = 0.0

    def describe(self) -> str:
        rate = self.sent / self.seconds if self.seconds > 0 else 0.0
        skipped = f", skipped {self.skipped} already present" if self.skipped else ""
        return (
            f"sent {self.sent} events ({self.bytes_sent} bytes), invalid {self.invalid}"
            f" (dead-lettered {self.dead_lettered}){skipped} in {self.seconds:.1f}s, {rate:.0f} events/s"
        )


def parse_line(line: SourceLine, mapping: Mapping, limits: PromptLimits = DEFAULT_LIMITS) -> PromptEvent:
    """Map and validate one line; raise :class:`InvalidLine` saying which rule failed."""
    try:
        event = to_event_dict(line, mapping.fmt, mapping.text_field, mapping.id_field, mapping.metadata_fields)
    except orjson.JSONDecodeError as exc:
        raise InvalidLine(line, ErrorClass.INVALID_JSON, f"not valid JSON: {exc}") from exc
    except MappingError as exc:
        raise InvalidLine(line, ErrorClass.INVALID_SHAPE, str(exc)) from exc
    if mapping.generation is not None and isinstance(event, dict) and "generation" not in event:
        event["generation"] = mapping.generation.model_dump(exclude_none=True)
    if (mapping.chat_template_kwargs is not None and isinstance(event, dict) and "messages" in event
            and "chat_template_kwargs" not in event):
        event["chat_template_kwargs"] = mapping.chat_template_kwargs
    try:
        return PromptEvent.model_validate_json(orjson.dumps(event), context={"limits": limits})
    except ValidationError as exc:
        raise InvalidLine(line, ErrorClass.INVALID_EVENT, format_validation_error(exc)) from exc


class Publisher:
    """Publishes validated prompt events with an idempotent producer
    (acks=all, key = request_id) and accounts for every line."""

    def __init__(
        self,
        producer: RecordProducer,
        topics: Topics,
        mapping: Mapping = Mapping(),
        limits: PromptLimits = DEFAULT_LIMITS,
        on_invalid: InvalidPolicy = InvalidPolicy.SKIP,
    ) -> None:
        self.producer = producer
        self.dead_letters = DeadLetters(producer, "producer")
        self.topics = topics
        self.mapping = mapping
        self.limits = limits
        self.on_invalid = on_invalid

    def publish(
        self,
        lines: Iterable[SourceLine],
        on_line: Callable[[PublishSummary], None] | None = None,
        skip_ids: Set[str] = frozenset(),
        on_sent: Callable[[PromptEvent], None] | None = None,
    ) -> PublishSummary:
        """Publish every line, then wait until Kafka acknowledged all of them.

        ``on_line(summary)`` is called after each line; valid events whose
        request id is in ``skip_ids`` (already done, say) are counted as skipped
        and not sent; ``on_sent(event)`` is called for each event queued.
        Raises :class:`InvalidLine` under the ``fail`` policy,
        ``DeliveryFailed`` when Kafka refused events or dead letters (how many,
        and the first one's reason)."""
        summary = PublishSummary()
        start = time.monotonic()
        try:
            for line in lines:
                event = self._publish_line(line, summary, skip_ids)
                if event is not None and on_sent is not None:
                    on_sent(event)
                if on_line is not None:
                    on_line(summary)
        finally:
            self.producer.flush()
            summary.seconds = time.monotonic() - start
        return summary

    def _publish_line(self, line: SourceLine, summary: PublishSummary, skip_ids: Set[str]) -> PromptEvent | None:
        """Send one line's event (returned) or account for why not (``None``)."""
        try:
            event = parse_line(line, self.mapping, self.limits)
        except InvalidLine as exc:
            summary.invalid += 1
            log.warning("invalid line %s", exc)
            if self.on_invalid is InvalidPolicy.FAIL:
                raise
            if self.on_invalid is InvalidPolicy.DLQ:
                self._dead_letter(exc)
                summary.dead_lettered += 1
            return None
        if sample_id(event.request_id) in skip_ids:
            summary.skipped += 1
            return None
        value = event.model_dump_json(exclude_none=True).encode()
        self.producer.produce(self.topics.prompts, value, key=event.request_id.encode())
        summary.sent += 1
        summary.bytes_sent += len(value)
        return event

    def _dead_letter(self, exc: InvalidLine) -> None:
        self.dead_letters.send(self.topics.prompts_dlq, exc, exc.line.raw, key=None, source_file=exc.line.source,
                               source_line=exc.line.line_no)
