"""Publishing ``hidden_states.ready`` events, and the sink's offset commits when
they share a Kafka transaction."""

from __future__ import annotations

import uuid
from collections.abc import Callable

from confluent_kafka import Consumer, Producer

from runtime.kafka import DeliveryFailed, make_producer
from runtime.kafka.commits import as_offsets, commit_watermarks
from runtime.kafka.watermarks import TopicPartitionKey, Watermarks
from runtime.settings import KafkaSettings
from schemas import HiddenStatesReady


class ReadyPublisher:
    """Publishes one ready event per stored sample; the records behind the events
    become committable only once Kafka has the events.

    Plain mode (the events share the sink's producer):
      1. produce the events;
      2. wait until Kafka acknowledged all of them (``DeliveryFailed`` after 60 s);
      3. mark the records done; the member commits them on its schedule.

    Exactly-once mode (a transactional producer of its own):
      1. begin a transaction and produce the events;
      2. mark the records done;
      3. send every committable offset to the transaction;
      4. commit the transaction: events and offsets become visible together;
      5. mark those positions committed.
    The member's periodic commit runs steps 1 and 3–5 with no events.
    """

    def __init__(self, kafka: KafkaSettings, producer: Producer, topic: str, marks: Watermarks,
                 transactional_id: str | None = None) -> None:
        self._topic = topic
        self._marks = marks
        self._consumer: Consumer | None = None
        self.transactional = transactional_id is not None
        self._producer = producer
        if transactional_id is not None:
            self._producer = make_producer(kafka, **{
                "transactional.id": f"{transactional_id}-{uuid.uuid4().hex}",
                # librdkafka requires it to cover the producer's delivery timeout.
                "transaction.timeout.ms": 300_000,
            })
            self._producer.init_transactions(30)

    def bind(self, consumer: Consumer) -> None:
        """The consumer whose offsets go into transactions (its group metadata)."""
        self._consumer = consumer

    def publish(self, events: list[HiddenStatesReady], done: Callable[[], None]) -> None:
        """Publish ``events``; ``done`` marks the records behind them done."""
        if self.transactional:
            self._producer.begin_transaction()
        for event in events:
            self._producer.produce(self._topic, value=event.model_dump_json().encode(), key=event.request_id.encode())
        if self.transactional:
            done()
            self._commit_transaction()
            return
        if self._producer.flush(60) > 0:
            raise DeliveryFailed("ready events not acknowledged within 60s")
        done()

    def commit(self, only: set[TopicPartitionKey] | None = None) -> None:
        """The member's commit: plain offsets, or (exactly-once) every committable
        offset in an otherwise empty transaction."""
        assert self._consumer is not None, "bind() first"
        if not self.transactional:
            commit_watermarks(self._consumer, self._marks, only)
        elif self._marks.to_commit():
            self._producer.begin_transaction()
            self._commit_transaction()

    def _commit_transaction(self) -> None:
        assert self._consumer is not None, "bind() first"
        positions = self._marks.to_commit()
        if positions:
            self._producer.send_offsets_to_transaction(as_offsets(positions), self._consumer.consumer_group_metadata())
        self._producer.commit_transaction(60)
        self._marks.committed(positions)
