"""Topic administration: services create the topics they use when missing."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable

from confluent_kafka import KafkaError, KafkaException
from confluent_kafka.admin import AdminClient, NewTopic

from runtime.kafka.config import client_config
from runtime.kafka.errors import KafkaUnavailable
from runtime.settings import KafkaSettings, TopicSettings

log = logging.getLogger(__name__)


def ensure_topics(
    kafka: KafkaSettings, topics: TopicSettings, names: Iterable[str], timeout: float = 60.0
) -> None:
    """Create each named topic that does not exist yet (with the configured
    partitions and replication factor) and wait until all are visible.

    An unreachable broker is retried until ``timeout`` (like the Java clients'
    ``max.block.ms``), so a service started during a short outage waits instead
    of failing."""
    admin = AdminClient(client_config(kafka))
    wanted = set(names)
    deadline = time.monotonic() + timeout
    while True:
        try:
            existing = set(admin.list_topics(timeout=max(1.0, min(10.0, deadline - time.monotonic()))).topics)
        except KafkaException as exc:
            if time.monotonic() > deadline:
                raise KafkaUnavailable(f"cannot list topics at {kafka.bootstrap}: {exc}") from exc
            log.warning("cannot list topics at %s yet (%s): retrying", kafka.bootstrap, exc)
            time.sleep(1.0)
            continue
        missing = wanted - existing
        if not missing:
            return
        if time.monotonic() > deadline:
            raise KafkaUnavailable(f"topics {sorted(missing)} did not appear within {timeout:.0f}s")
        _create(admin, topics, missing)
        time.sleep(0.2)


def _create(admin: AdminClient, topics: TopicSettings, names: set[str]) -> None:
    new = [NewTopic(n, topics.partitions, topics.replication_factor) for n in sorted(names)]
    for name, future in admin.create_topics(new).items():
        try:
            future.result()
            log.info("created topic %s (%d partitions)", name, topics.partitions)
        except KafkaException as exc:
            # Another member may have created it a moment ago: that is fine.
            if exc.args[0].code() != KafkaError.TOPIC_ALREADY_EXISTS:
                raise
