"""Publish prompt events to Kafka: read JSONL (or common dataset shapes), validate
each line against ``schemas.PromptEvent``, produce idempotently keyed by request id."""

from producer.publisher import InvalidPolicy, Publisher, PublishSummary
from producer.sources import DatasetFormat, SourceLine, read_jsonl, to_event_dict

__all__ = [
    "DatasetFormat",
    "InvalidPolicy",
    "PublishSummary",
    "Publisher",
    "SourceLine",
    "read_jsonl",
    "to_event_dict",
]
