"""Errors raised by the Kafka layer."""

from __future__ import annotations

from runtime.errors import ExitCode, HsxError


class KafkaUnavailable(HsxError):
    """The cluster did not answer within the allowed time."""

    exit_code = ExitCode.UNAVAILABLE


class DeliveryFailed(HsxError):
    """Kafka rejected a record for good (librdkafka already retried it)."""
