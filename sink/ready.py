"""Publishing ``hidden_states.ready`` events, and the sink's offset commits when
they share a Kafka transaction."""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable

from confluent_kafka import Consumer, KafkaException

from hsx.runtime.kafka import DeliveryFailed, RecordProducer
from hsx.runtime.kafka.commits import as_offsets, commit_watermarks
from hsx.runtime.kafka.watermarks import TopicPartitionKey, Watermarks
from hsx.runtime.settings import KafkaSettings
from hsx.schemas import HiddenStatesReady

log = logging.getLogger(__name__)

PUBLISH_TIMEOUT_S = 60.0
"""How long one shard's ready events may take to be acknowledged."""


class ReadyPublisher:
    """Publishes one ready event per stored sample; the records behind the events
    become committable only once Kafka has the events. A refused event, or one
    not acknowledged in time, raises :class:`DeliveryFailed`; the publisher then
    commits nothing more (the sink stops; its restart finds the samples stored
    and announces them again).

    Plain mode (the events share the sink's producer):
      1. produce the events;
      2. wait until Kafka acknowledged every one of them by its delivery report;
      3. mark the records done; the member commits them on its schedule.

    Exactly-once mode (a transactional producer of its own):
      1. begin a transaction and produce the events;
      2. mark the records done;
      3. send every committable offset to the transaction;
      4. commit the transaction: events and offsets become visible together
         (a failed commit is aborted: neither becomes visible);
      5. mark those positions committed.
    The member's periodic commit runs steps 1 and 3–5 with no events.
    """

    def __init__(self, kafka: KafkaSettings, producer: RecordProducer, topic: str, marks: Watermarks,
                 transactional_id: str | None = None) -> None:
        self._topic = topic
        self._marks = marks
        self._consumer: Consumer | None = None
        self._failed: DeliveryFailed | None = None
        self.transactional = transactional_id is not None
        self._producer = producer
        if transactional_id is not None:
            self._producer = RecordProducer.connect(kafka, "sink", **{
                "transactional.id": f"{transactional_id}-{uuid.uuid4().hex}",
                # librdkafka requires it to cover the producer's delivery timeout.
                "transaction.timeout.ms": 300_000,
            })
            self._producer.client.init_transactions(30)

    def bind(self, consumer: Consumer) -> None:
        """The consumer whose offsets go into transactions (its group metadata)."""
        self._consumer = consumer

    def publish(self, events: list[HiddenStatesReady], done: Callable[[], None]) -> None:
        """Publish ``events``; ``done`` marks the records behind them done. Raises
        :class:`DeliveryFailed` when Kafka did not take every event."""
        self._check()
        if self.transactional:
            self._producer.client.begin_transaction()
        for event in events:
            self._producer.produce(self._topic, event.model_dump_json().encode(), event.request_id.encode())
        if self.transactional:
            done()
            self._commit_transaction()
            return
        try:
            self._producer.flush(PUBLISH_TIMEOUT_S)
        except DeliveryFailed as exc:
            self._failed = DeliveryFailed(f"ready events of {len(events)} stored samples not delivered: {exc}")
            raise self._failed from exc
        done()

    def commit(self, only: set[TopicPartitionKey] | None = None) -> None:
        """The member's commit: plain offsets, or (exactly-once) every committable
        offset in an otherwise empty transaction. Nothing after a failed publish."""
        assert self._consumer is not None, "bind() first"
        if self._failed is not None:
            return
        if not self.transactional:
            commit_watermarks(self._consumer, self._marks, only)
        elif self._marks.to_commit():
            self._producer.client.begin_transaction()
            self._commit_transaction()

    def _check(self) -> None:
        if self._failed is not None:
            raise self._failed

    def _commit_transaction(self) -> None:
        """Steps 3-5; a transaction that cannot commit is aborted, and the
        records it covered are never committed by this publisher."""
        assert self._consumer is not None, "bind() first"
        positions = self._marks.to_commit()
        try:
            if positions:
                self._producer.client.send_offsets_to_transaction(as_offsets(positions),
                                                                  self._consumer.consumer_group_metadata())
            self._producer.client.commit_transaction(PUBLISH_TIMEOUT_S)
        except (KafkaException, DeliveryFailed) as exc:
            self._abort()
            self._failed = DeliveryFailed(f"transaction not committed (aborted): {exc}")
            raise self._failed from exc
        self._marks.committed(positions)

    def _abort(self) -> None:
        try:
            self._producer.client.abort_transaction(PUBLISH_TIMEOUT_S)
        except KafkaException as exc:  # a fenced or fatal producer: the broker aborts it on timeout
            log.warning("aborting the transaction failed too: %s", exc)
