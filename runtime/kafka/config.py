"""librdkafka configurations for hsx's clients: safe defaults, then the user's
connection and security settings, then per-call overrides."""

from __future__ import annotations

import logging
from typing import Any

from hsx.runtime.settings import KafkaSettings

_RDKAFKA_LOG = logging.getLogger("hsx.rdkafka")

# Block records are up to a few MiB; raise the client-side cap above the
# default 1 MB so they are never rejected locally (brokers need the same).
MAX_MESSAGE_BYTES = 16 * 1024 * 1024
METADATA_TIMEOUT_S = 30.0
"""How long a reader waits for topic metadata or committed offsets."""
SEES_NEW_TOPICS = {"topic.metadata.refresh.interval.ms": 10_000}
"""For a reader that may subscribe before its topic exists (a trainer following
``hidden_states.ready`` before the sink's first start created it): librdkafka
notices a subscribed topic only at its next metadata refresh, every 5 minutes by
default; with this, within 10 s."""


def client_config(settings: KafkaSettings, **overrides: Any) -> dict[str, Any]:
    """Connection and security settings, with librdkafka's logs routed into
    Python logging (``hsx.rdkafka``) instead of raw stderr lines."""
    config: dict[str, Any] = {"logger": _RDKAFKA_LOG, **settings.client_config()}
    config.update(overrides)
    return config


def producer_config(settings: KafkaSettings, **overrides: Any) -> dict[str, Any]:
    """An idempotent producer (acks=all, ordered, no duplicates on retry)."""
    config: dict[str, Any] = {
        "enable.idempotence": True,
        "acks": "all",
        "linger.ms": 5,
        "message.max.bytes": MAX_MESSAGE_BYTES,
        # Give up on a record only after 5 minutes; a broker outage shorter than
        # that is ridden out by librdkafka's own retries.
        "delivery.timeout.ms": 300_000,
    }
    config.update(client_config(settings, **overrides))
    return config


def consumer_config(settings: KafkaSettings, group_id: str, **overrides: Any) -> dict[str, Any]:
    """A consumer-group member that commits only what the service stored
    explicitly (no auto-commit, no auto offset store), with cooperative
    rebalancing so a rebalance does not stop every member."""
    config: dict[str, Any] = {
        "group.id": group_id,
        "enable.auto.commit": False,
        "enable.auto.offset.store": False,
        "auto.offset.reset": "earliest",
        "partition.assignment.strategy": "cooperative-sticky",
        "isolation.level": "read_committed",
        "fetch.max.bytes": 4 * MAX_MESSAGE_BYTES,
        "max.partition.fetch.bytes": MAX_MESSAGE_BYTES,
    }
    config.update(client_config(settings, **overrides))
    return config
