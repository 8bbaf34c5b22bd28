"""Errors raised by the Kafka layer."""

from __future__ import annotations


class KafkaUnavailable(RuntimeError):
    """The cluster did not answer within the allowed time."""


class DeliveryFailed(RuntimeError):
    """Kafka rejected a record for good (librdkafka already retried it)."""
