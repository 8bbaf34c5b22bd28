"""Logging setup shared by every hsx command: human-readable text on a terminal,
one JSON object per line (``--log-format json``) for log collectors, and secrets
from the configuration masked in everything the process writes out."""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterable
from typing import Literal

LogFormat = Literal["text", "json"]
MASK = "***"


class _Redactor(logging.Filter):
    """Replaces known secrets with ``***``: as a filter on the log handler, and
    through :func:`redact` for other text that leaves the process (dead-letter
    reasons quote exception messages, which may quote the configuration)."""

    def __init__(self) -> None:
        super().__init__()
        self._secrets: list[str] = []

    def add(self, secrets: Iterable[str]) -> None:
        # Longest first, so a secret that contains another is masked whole.
        self._secrets = sorted({*self._secrets, *(s for s in secrets if s)}, key=len, reverse=True)

    def __call__(self, text: str) -> str:
        for secret in self._secrets:
            text = text.replace(secret, MASK)
        return text

    def filter(self, record: logging.LogRecord) -> bool:
        if self._secrets:
            record.msg, record.args = self(record.getMessage()), None
            if record.exc_info:
                record.exc_text = self(logging.Formatter().formatException(record.exc_info))
                record.exc_info = None
        return True


_REDACTOR = _Redactor()


def redact_secrets(secrets: Iterable[str]) -> None:
    """Mask these values (e.g. ``KafkaSettings.secret_values()``) in every log line
    and in :func:`redact` from now on."""
    _REDACTOR.add(secrets)


def redact(text: str) -> str:
    """``text`` with every registered secret masked."""
    return _REDACTOR(text)


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
    handler.addFilter(_REDACTOR)
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
