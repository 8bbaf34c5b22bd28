"""The one dead-letter path: producer, extractor and sink all publish rejected
input through :class:`DeadLetters`.

Failure policy: a dead letter that Kafka refuses (librdkafka has already retried
it for ``delivery.timeout.ms``, 5 minutes) is fatal, like every refused record
(see :class:`~hsx.runtime.kafka.producer.RecordProducer`). The record behind it must
not be committed (it would be lost), and a service that keeps running with it
uncommitted stalls its partition without saying so. So the service is told at
once (the producer's ``on_refused``), stops, and exits 1 without committing past
the record; its restart reads it again and re-rejects it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from hsx.runtime.errors import InvalidInput
from hsx.runtime.kafka.producer import RecordProducer
from hsx.runtime.logs import record_fields, redact
from hsx.schemas import DlqHeaders

log = logging.getLogger(__name__)


class DeadLetters:
    """Publishes the original bytes of rejected input, untouched, with
    :class:`~hsx.schemas.DlqHeaders` saying what was wrong and where it came from."""

    def __init__(self, producer: RecordProducer, service: str) -> None:
        self.producer = producer
        self._service = service

    def send(
        self,
        topic: str,
        rejection: InvalidInput,
        value: bytes | None,
        key: bytes | None,
        on_acked: Callable[[], None] | None = None,
        **source: str | int | None,
    ) -> None:
        """Queue one dead letter; ``on_acked`` runs once Kafka acknowledged it.
        ``source`` is ``source_topic/partition/offset`` or ``source_file/line``."""
        request_id = key.decode("utf-8", "replace") if key else None
        log.warning("dead letter to %s: %s: %s", topic, rejection.error_class.value, rejection.reason,
                    extra=record_fields(request_id, source.get("source_topic"), source.get("source_partition"),
                                        source.get("source_offset")))
        headers = DlqHeaders.build(rejection.error_class, redact(rejection.reason), service=self._service, **source)
        self.producer.produce(topic, value, key, headers.to_kafka(), on_acked)
