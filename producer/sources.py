"""Reading input files and mapping common dataset shapes onto prompt events.

Mapping only reshapes; whether the result is a valid event is decided by
``hsx.schemas.PromptEvent`` alone.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from decimal import Decimal
from enum import Enum
from typing import IO, Any

import orjson

from hsx.runtime.errors import UsageError


class DatasetFormat(str, Enum):
    """Shapes of input lines that ``hsx produce`` understands."""

    EVENT = "event"
    """Already a PromptEvent (``request_id`` optional)."""
    TEXT = "text"
    """A text field (``--text-field``, default ``text``) becomes ``prompt``."""
    SHAREGPT = "sharegpt"
    """``conversations: [{from, value}, ...]`` becomes ``messages``."""
    OPENAI = "openai"
    """``messages: [{role, content}, ...]`` as in OpenAI chat datasets."""


class MappingError(ValueError):
    """A line's shape does not match the chosen dataset format."""


# ShareGPT speakers seen in the wild, onto the PromptEvent roles.
SHAREGPT_ROLES = {
    "system": "system",
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "chatgpt": "assistant",
    "bing": "assistant",
    "bard": "assistant",
    "tool": "tool",
    "function": "tool",
    "observation": "tool",
}


@dataclass(frozen=True)
class SourceLine:
    """One input row, as JSON bytes, and where it came from."""

    source: str
    """File name (basename), ``stdin``, or ``<directory>/<split>`` for a dataset
    saved with ``datasets``; part of the generated request ids."""
    line_no: int
    """JSONL: the line number; other inputs: the row number in the file or split.
    Both count from 1 and do not depend on ``--shuffle``."""
    raw: bytes


def read_jsonl(stream: IO[bytes], source: str) -> Iterator[SourceLine]:
    """Yield the non-blank lines of a JSONL stream with 1-based line numbers."""
    for line_no, raw in enumerate(stream, start=1):
        raw = raw.rstrip(b"\r\n")
        if raw.strip():
            yield SourceLine(source, line_no, raw)


def record_line(source: str, row_no: int, record: Any, drop_nulls: bool = False) -> SourceLine:
    """A row read by a parser (JSON array, Arrow) as a :class:`SourceLine` whose
    ``raw`` is its JSON, so mapping and generated ids work as for JSONL lines.

    ``drop_nulls`` drops a dict's top-level nulls: a table cannot leave a field
    out of one row, so there a null stands for "absent" (a row without an id
    has ``request_id: null``, which would fail instead of getting a generated
    id; a metadata field missing from a row would be copied as null).
    """
    if drop_nulls and isinstance(record, dict):
        record = {key: value for key, value in record.items() if value is not None}
    try:
        return SourceLine(source, row_no, orjson.dumps(record, default=_json_default))
    except TypeError as exc:  # orjson.JSONEncodeError is a TypeError
        raise UsageError(f"{source}: row {row_no} cannot be written as JSON: {exc}") from exc


def _json_default(value: Any) -> Any:
    # Decimals: Arrow decimal columns; floats are what orjson.loads would give for JSON.
    if isinstance(value, Decimal):
        return float(value)
    # Arrow binary columns often hold UTF-8 text; anything else has no JSON form.
    if isinstance(value, bytes):
        return value.decode("utf-8")
    raise TypeError(f"{type(value).__name__} is not JSON serializable")


_UNSAFE = re.compile(r"[^A-Za-z0-9._-]+")


def generated_request_id(line: SourceLine) -> str:
    """A request id derived from the file name, line number and content, so that
    re-publishing a file never invents new ids: ``<name>:<line>:<hash>``."""
    name = _UNSAFE.sub("_", line.source).replace("..", "_")[:48] or "input"
    digest = hashlib.sha256(b"%s\n%d\n%s" % (line.source.encode(), line.line_no, line.raw)).hexdigest()[:16]
    return f"{name}:{line.line_no}:{digest}"


def to_event_dict(
    line: SourceLine,
    fmt: DatasetFormat,
    text_field: str = "text",
    id_field: str | None = None,
    metadata_fields: Iterable[str] = (),
) -> dict[str, Any]:
    """Parse one line and reshape it into a PromptEvent-shaped dict.

    Raises ``orjson.JSONDecodeError`` for bad JSON and :class:`MappingError` when
    the line lacks what ``fmt`` needs; the result is validated by the caller.
    """
    record = orjson.loads(line.raw)
    if not isinstance(record, dict):
        raise MappingError(f"line is a JSON {type(record).__name__}, expected an object")
    if fmt is DatasetFormat.EVENT:
        event = dict(record)
    else:
        event = {"messages" if fmt is not DatasetFormat.TEXT else "prompt": _map_body(record, fmt, text_field)}
        metadata = {name: record[name] for name in metadata_fields if name in record}
        if metadata:
            event["metadata"] = metadata
    if id_field is not None:
        if id_field not in record:
            raise MappingError(f"missing id field {id_field!r}")
        event["request_id"] = record[id_field]
    if "request_id" not in event:
        event["request_id"] = generated_request_id(line)
    return event


def _map_body(record: dict[str, Any], fmt: DatasetFormat, text_field: str) -> Any:
    if fmt is DatasetFormat.TEXT:
        if text_field not in record:
            raise MappingError(f"missing text field {text_field!r}")
        return record[text_field]
    if fmt is DatasetFormat.OPENAI:
        if "messages" not in record:
            raise MappingError("missing field 'messages'")
        return record["messages"]
    turns = record.get("conversations")
    if not isinstance(turns, list):
        raise MappingError("missing list field 'conversations'")
    return [_sharegpt_turn(i, turn) for i, turn in enumerate(turns)]


def _sharegpt_turn(index: int, turn: Any) -> dict[str, Any]:
    if not isinstance(turn, dict) or "from" not in turn or "value" not in turn:
        raise MappingError(f"conversations[{index}] must be an object with 'from' and 'value'")
    speaker = turn["from"]
    role = SHAREGPT_ROLES.get(speaker.lower()) if isinstance(speaker, str) else None
    if role is None:
        raise MappingError(
            f"conversations[{index}].from: unknown speaker {speaker!r} (known: {', '.join(sorted(SHAREGPT_ROLES))})"
        )
    return {"role": role, "content": turn["value"]}
