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
