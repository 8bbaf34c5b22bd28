"""The one dead-letter path: producer, extractor and sink all publish rejected
input through :class:`DeadLetters`.

Failure policy: a dead letter that Kafka does not acknowledge (librdkafka has
already retried it for ``delivery.timeout.ms``, 5 minutes) is fatal. The record
behind it must not be committed (it would be lost), and a service that keeps
running with it uncommitted stalls its partition without saying so. So the
service is told at once (``on_lost``), stops, and exits 1 without committing
past the record; its restart reads it again and re-rejects it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from confluent_kafka import KafkaError, Message, Producer

from runtime.errors import Rejection, ServiceFailed
from runtime.logs import record_fields, redact
from schemas import DlqHeaders

log = logging.getLogger(__name__)


class DeadLetters:
    """Publishes the original bytes of rejected input, untouched, with
    :class:`~schemas.DlqHeaders` saying what was wrong and where it came from."""

    def __init__(self, producer: Producer, service: str, on_lost: Callable[[ServiceFailed], None] | None = None) -> None:
        self.producer = producer
        self.lost: ServiceFailed | None = None
        """The first dead letter Kafka refused, if any."""
        self._service = service
        self._on_lost = on_lost

    def send(
        self,
        topic: str,
        rejection: Rejection,
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

        def delivered(err: KafkaError | None, _msg: Message) -> None:
            if err is None:
                if on_acked is not None:
                    on_acked()
            else:
                self._lose(ServiceFailed(f"dead-letter topic {topic} unreachable: {err.str()}"))

        while True:
            try:
                self.producer.produce(topic, value=value, key=key, headers=headers.to_kafka(), on_delivery=delivered)
                return
            except BufferError:  # librdkafka's queue is full: serve deliveries until there is room
                self.producer.poll(0.1)

    def check(self) -> None:
        """Raise :class:`ServiceFailed` if a dead letter was lost."""
        if self.lost is not None:
            raise self.lost

    def _lose(self, error: ServiceFailed) -> None:
        if self.lost is None:
            self.lost = error
        if self._on_lost is not None:
            self._on_lost(error)
