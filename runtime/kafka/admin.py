"""Topic administration: services create the topics they use when missing."""

from __future__ import annotations

import argparse
import logging
import math
import time
from collections.abc import Iterable

from confluent_kafka import KafkaError, KafkaException
from confluent_kafka.admin import AdminClient, NewTopic

from hsx.runtime.checks import number
from hsx.runtime.kafka.config import client_config
from hsx.runtime.kafka.errors import KafkaUnavailable
from hsx.runtime.settings import KafkaSettings, TopicSettings

log = logging.getLogger(__name__)


ONE_SHOT_CONNECT_TIMEOUT = 60.0
"""``--connect-timeout`` of one-shot commands (``hsx produce``, ``hsx run`` with a
cluster): a user at a terminal wants an answer, but a short broker outage (a
rolling restart, 30 s in the reliability suite) must be ridden out, as the Java
clients' ``max.block.ms`` does; services wait for ever."""
TOPICS_APPEAR_SECONDS = 60.0
"""Once the cluster answers, how long created topics may take to show up."""
ATTEMPT_SECONDS = 2.0
"""One metadata request's wait: short, so that the wait is reported soon."""


def ensure_topics(
    kafka: KafkaSettings, topics: TopicSettings, names: Iterable[str], timeout: float | None = None
) -> None:
    """Create each named topic that does not exist yet (with the configured
    partitions and replication factor) and wait until all are visible.

    An unreachable cluster is waited for (:func:`wait_for_cluster`): up to
    ``timeout`` seconds, then :class:`KafkaUnavailable` (exit 3); ``None`` waits
    for ever, as services do, so one started during an outage rides it out."""
    admin = AdminClient(client_config(kafka))
    wanted = set(names)
    existing = _list_topics(admin, kafka.bootstrap, timeout)
    deadline = time.monotonic() + TOPICS_APPEAR_SECONDS
    while missing := wanted - existing:
        if time.monotonic() > deadline:
            raise KafkaUnavailable(f"topics {sorted(missing)} did not appear within {TOPICS_APPEAR_SECONDS:.0f}s")
        _create(admin, topics, missing)
        time.sleep(0.2)
        existing = _list_topics(admin, kafka.bootstrap, timeout)


def add_connect_timeout(parser: argparse.ArgumentParser | argparse._ArgumentGroup,
                        default: float | None, cluster: str = "the Kafka cluster") -> None:
    """``--connect-timeout SECS``, with ``default`` (``None``: for ever) said in ``--help``."""
    said = "for ever: a service rides out an outage" if default is None else f"{default:g}s"
    parser.add_argument("--connect-timeout", type=number(0), default=default, metavar="SECS",
                        help=f"how long to wait for {cluster} to answer, then exit 3 (default {said})")


def wait_for_cluster(kafka: KafkaSettings, timeout: float | None = None) -> None:
    """Return once the cluster answers a metadata request; :class:`KafkaUnavailable`
    after ``timeout`` seconds (``None``: wait for ever). The wait is logged once
    when it starts and once when it ends, never per retry."""
    _list_topics(AdminClient(client_config(kafka)), kafka.bootstrap, timeout)


def _list_topics(admin: AdminClient, bootstrap: str, timeout: float | None) -> set[str]:
    started = time.monotonic()
    deadline = math.inf if timeout is None else started + timeout
    waiting = False
    while True:
        attempt = max(0.1, min(ATTEMPT_SECONDS, deadline - time.monotonic()))
        try:
            names = set(admin.list_topics(timeout=attempt).topics)
        except KafkaException as exc:
            reason = exc.args[0].str() if exc.args and isinstance(exc.args[0], KafkaError) else str(exc)
            if time.monotonic() >= deadline:
                raise KafkaUnavailable(f"no Kafka cluster answered at {bootstrap} within {timeout:g}s "
                                       f"(--connect-timeout): {reason}") from exc
            if not waiting:
                limit = "for ever (--connect-timeout bounds it)" if timeout is None else f"up to {timeout:g}s"
                log.warning("waiting for the Kafka cluster at %s (%s): %s", bootstrap, reason, limit)
                waiting = True
            time.sleep(max(0.0, min(1.0, deadline - time.monotonic())))
            continue
        if waiting:
            log.info("the Kafka cluster at %s answered after %.0fs", bootstrap, time.monotonic() - started)
        return names


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
