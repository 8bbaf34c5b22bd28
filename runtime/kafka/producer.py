"""Producer construction and delivery accounting."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from confluent_kafka import KafkaError, Message, Producer

from runtime.kafka.config import producer_config
from runtime.kafka.errors import DeliveryFailed
from runtime.settings import KafkaSettings


def make_producer(settings: KafkaSettings, **overrides: Any) -> Producer:
    """An idempotent producer with the user's connection and security settings."""
    return Producer(producer_config(settings, **overrides))


@dataclass
class DeliveryTracker:
    """Produces through one producer and accounts for every record: acknowledged,
    failed (with Kafka's reason) or still in flight. Nothing fails silently."""

    producer: Producer
    acked: int = 0
    pending: int = 0
    failures: list[tuple[bytes | None, KafkaError]] = field(default_factory=list)

    def produce(
        self,
        topic: str,
        value: bytes,
        key: bytes | None = None,
        headers: list[tuple[str, bytes]] | None = None,
    ) -> None:
        """Queue one record; when librdkafka's local queue is full, serve delivery
        reports until there is room (backpressure instead of an error)."""
        while True:
            try:
                self.producer.produce(topic, value=value, key=key, headers=headers, on_delivery=self._on_delivery)
                self.pending += 1
                return
            except BufferError:
                self.producer.poll(0.1)

    def _on_delivery(self, err: KafkaError | None, msg: Message) -> None:
        self.pending -= 1
        if err is None:
            self.acked += 1
        else:
            self.failures.append((msg.key(), err))

    def flush(self, timeout: float = 60.0) -> None:
        """Wait for every queued record; raise :class:`DeliveryFailed` if any was
        rejected or is still unacknowledged after ``timeout`` seconds."""
        self.producer.flush(timeout)
        if self.failures:
            key, err = self.failures[0]
            raise DeliveryFailed(f"{len(self.failures)} record(s) not delivered; first (key={key!r}): {err.str()}")
        if self.pending:
            raise DeliveryFailed(f"{self.pending} record(s) still unacknowledged after {timeout:.0f}s")
