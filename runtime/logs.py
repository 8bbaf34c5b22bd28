"""Logging setup shared by every hsx command: human-readable text on a terminal,
one JSON object per line (``--log-format json``) for log collectors."""

from __future__ import annotations

import logging
import sys
from typing import Literal

LogFormat = Literal["text", "json"]


def configure_logging(level: str = "INFO", fmt: LogFormat = "text") -> None:
    """Configure the root logger once per process. librdkafka's own logs are
    routed into the ``hsx.rdkafka`` logger by the Kafka layer."""
    handler = logging.StreamHandler(sys.stderr)
    if fmt == "json":
        from pythonjsonlogger.json import JsonFormatter

        handler.setFormatter(
            JsonFormatter("%(asctime)s %(levelname)s %(name)s %(message)s", rename_fields={"levelname": "level"})
        )
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)-7s %(name)s: %(message)s", "%H:%M:%S"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())


def record_fields(
    request_id: str | None = None, topic: str | None = None, partition: int | None = None, offset: int | None = None
) -> dict[str, object]:
    """``extra=`` for a log call about one record: with ``--log-format json`` these
    become fields of the line, so logs can be filtered by request or offset."""
    fields = {"request_id": request_id, "topic": topic, "partition": partition, "offset": offset}
    return {k: v for k, v in fields.items() if v is not None}
