"""Errors raised by the Kafka layer, and the one policy for errors a consumer reports."""

from __future__ import annotations

import logging
from collections import Counter

from confluent_kafka import KafkaError

from hsx.runtime.errors import ExitCode, HsxError
from hsx.runtime.metrics import kafka_errors

log = logging.getLogger(__name__)


class KafkaUnavailable(HsxError):
    """The cluster did not answer within the allowed time."""

    exit_code = ExitCode.UNAVAILABLE


class DeliveryFailed(HsxError):
    """Kafka refused a record for good (librdkafka already retried it)."""


class KafkaFatal(HsxError):
    """A Kafka client cannot go on: librdkafka says the error is fatal, or the
    cluster refuses this client's access (retrying cannot help)."""


# Errors no retry can cure: librdkafka's fatal() covers the client's own state
# (idempotence, fencing); these are the cluster refusing the client's access.
_REFUSALS = frozenset({
    KafkaError.TOPIC_AUTHORIZATION_FAILED,
    KafkaError.GROUP_AUTHORIZATION_FAILED,
    KafkaError.CLUSTER_AUTHORIZATION_FAILED,
    KafkaError.SASL_AUTHENTICATION_FAILED,
    KafkaError._AUTHENTICATION,
})


class ConsumerErrors:
    """What every hsx consumer does with an error librdkafka hands it (the
    services' group member, ``follow``, the trainer's stream, ``hsx run``'s ledger):

    - end of partition: not an error, ignored;
    - fatal, or access refused: :class:`KafkaFatal` is raised (a service stops);
    - anything else is transient (librdkafka retries it): logged once per kind,
      then counted in :attr:`counts` and the ``hsx_kafka_client_errors`` metric.
    """

    def __init__(self, client: str) -> None:
        self.counts: Counter[str] = Counter()
        self._client = client

    def check(self, error: KafkaError) -> None:
        if error.code() == KafkaError._PARTITION_EOF:
            return
        if error.fatal() or error.code() in _REFUSALS:
            raise KafkaFatal(f"Kafka: {error.str()}")
        kind = error.name()
        self.counts[kind] += 1
        kafka_errors.labels(self._client, kind).inc()
        if self.counts[kind] == 1:
            log.warning("%s: Kafka reports %s (transient, retried; further ones are counted in "
                        "hsx_kafka_client_errors{kind=%r})", self._client, error.str(), kind)
