"""Dead-letter records: the original bytes, untouched, with headers saying what
was wrong and where the record came from."""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated

from pydantic import Field

from hsx.schemas.common import StrictModel

MAX_MESSAGE_CHARS = 2_000
_PREFIX = "hsx-"


class ErrorClass(StrEnum):
    """Every rule a record can break, by the service that finds it out. The values
    are stable, machine-readable names that DLQ consumers may match on."""

    # producer: a line of an input file
    INVALID_JSON = "invalid_json"
    INVALID_SHAPE = "invalid_shape"
    INVALID_EVENT = "invalid_event"
    """Not a valid ``PromptEvent`` (also found by the extractor on ``prompts``)."""
    # extractor: what only the model can judge
    EMPTY_PROMPT = "empty_prompt"
    PROMPT_TOO_LONG = "prompt_too_long"
    TOKEN_OUT_OF_VOCABULARY = "token_out_of_vocabulary"
    CHAT_TEMPLATE_ERROR = "chat_template_error"
    CHAT_TEMPLATE_UNSUPPORTED = "chat_template_unsupported"
    IMAGES_UNSUPPORTED = "images_unsupported"
    """A chat with images, which this extractor cannot run (the message names the part)."""
    ENGINE_REJECTED = "engine_rejected"
    EXTRACTION_FAILED = "extraction_failed"
    GENERATION_FAILED = "generation_failed"
    # sink: block records and manifests
    INVALID_RECORD = "invalid_record"
    INVALID_MANIFEST = "invalid_manifest"
    INCOMPLETE_SAMPLE = "incomplete_sample"
    SUPERSEDED_ATTEMPT = "superseded_attempt"
    CORRUPT_BLOCK = "corrupt_block"
    SHAPE_MISMATCH = "shape_mismatch"
    CONFLICTING_DUPLICATE = "conflicting_duplicate"
    SAMPLE_TOO_LARGE = "sample_too_large"
    """The manifest declares more hidden-state bytes than ``hsx sink --max-sample-bytes``."""
    # sink: by-reference manifests (the error message names the staged object)
    PAYLOAD_FORBIDDEN = "payload_forbidden"
    """The manifest names an object other than its attempt's staged key."""
    PAYLOAD_MISSING = "payload_missing"
    PAYLOAD_CORRUPT = "payload_corrupt"
    """The staged object is shorter than its manifest says, or a block in it does not verify."""
    # any service: the last line of defence
    UNEXPECTED = "unexpected"
    """Checking the record raised an exception no rule names (its type and message
    are the reason): a defect in hsx to report, dead-lettered so the loop goes on."""


class DlqHeaders(StrictModel):
    """Why a record was dead-lettered and where it came from: a Kafka record
    (topic/partition/offset) or a line of an input file (file/line)."""

    error_class: ErrorClass
    """The rule the record broke, e.g. ``invalid_event``, ``prompt_too_long``."""
    error_message: Annotated[str, Field(max_length=MAX_MESSAGE_CHARS)]
    service: str
    source_topic: str | None = None
    source_partition: int | None = None
    source_offset: int | None = None
    source_file: str | None = None
    source_line: int | None = None

    @classmethod
    def build(cls, error_class: ErrorClass | str, error_message: str, **source: str | int | None) -> DlqHeaders:
        """Like the constructor, but truncates an over-long message instead of failing:
        a dead letter must never fail to be written because of its own reason."""
        if len(error_message) > MAX_MESSAGE_CHARS:
            error_message = error_message[: MAX_MESSAGE_CHARS - 3] + "..."
        return cls(error_class=ErrorClass(error_class), error_message=error_message, **source)

    def to_kafka(self) -> list[tuple[str, bytes]]:
        """As Kafka headers named ``hsx-error-class``, ``hsx-source-offset``, ..."""
        return [
            (_PREFIX + name.replace("_", "-"), str(value).encode())
            for name, value in self.model_dump(exclude_none=True).items()
        ]

    @classmethod
    def from_kafka(cls, headers: list[tuple[str, bytes | None]] | None) -> DlqHeaders:
        """Inverse of :meth:`to_kafka`; raises ``ValidationError`` naming the bad
        header. A value that is not UTF-8 is read with its bad bytes replaced
        (U+FFFD), so it fails the field's own rule or passes as text, never as
        a ``UnicodeDecodeError`` no caller expects."""
        fields = {}
        for key, value in headers or []:
            if key.startswith(_PREFIX) and value is not None:
                fields[key[len(_PREFIX):].replace("-", "_")] = value.decode("utf-8", "replace")
        return cls.model_validate(fields, strict=False)
