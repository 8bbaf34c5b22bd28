"""Publish prompt events to Kafka: read prompts (JSONL, JSON arrays, Parquet,
Arrow, ``datasets`` directories; common dataset shapes), validate each row
against ``hsx.schemas.PromptEvent``, produce idempotently keyed by request id."""

from hsx.producer.inputs import InputKind, InputRows, InputSpec, check_input, open_input, read_input
from hsx.producer.publisher import InvalidPolicy, Publisher, PublishSummary
from hsx.producer.sources import DatasetFormat, SourceLine, read_jsonl, to_event_dict

__all__ = [
    "DatasetFormat",
    "InputKind",
    "InputRows",
    "InputSpec",
    "InvalidPolicy",
    "PublishSummary",
    "Publisher",
    "SourceLine",
    "check_input",
    "open_input",
    "read_input",
    "read_jsonl",
    "to_event_dict",
]
