"""The one way hsx produces: :class:`RecordProducer`.

Prompts, block records, manifests, dead letters and ready events all go through
it, so every record is accounted for by its own delivery report. librdkafka
empties its queue when a record *fails* too (delivery timeout, unknown topic,
authorization, record too large), so ``flush() == 0`` never means "delivered";
only a delivery report without an error does.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from confluent_kafka import KafkaError, Message, Producer

from hsx.runtime.kafka.config import producer_config
from hsx.runtime.kafka.errors import DeliveryFailed
from hsx.runtime.metrics import produced_records
from hsx.runtime.settings import KafkaSettings

log = logging.getLogger(__name__)

Headers = list[tuple[str, bytes]]


def make_producer(settings: KafkaSettings, **overrides: Any) -> Producer:
    """An idempotent librdkafka producer with the user's connection and security
    settings (wrap it in :class:`RecordProducer` to produce)."""
    return Producer(producer_config(settings, **overrides))


class RecordProducer:
    """Produces through one producer and accounts for every record.

    1. :meth:`produce` queues a record; ``on_acked`` runs once Kafka acknowledged it.
    2. A record Kafka refuses (its delivery report carries an error) is never
       counted as sent: its ``on_acked`` never runs, its own ``on_refused_record``
       (if given) hears of it, and the first refusal is kept in :attr:`refused`
       and passed to ``on_refused`` (for the services: stop, commit nothing past
       the record, exit 1).
    3. :meth:`flush` waits for every queued record and raises
       :class:`DeliveryFailed` if one was refused or is still unacknowledged.

    Delivery reports run on whichever thread calls :meth:`poll` or :meth:`flush`.
    """

    def __init__(self, producer: Producer, service: str,
                 on_refused: Callable[[DeliveryFailed], None] | None = None) -> None:
        self.client = producer
        """The librdkafka producer (for transactions and metadata)."""
        self.refused: DeliveryFailed | None = None
        """The first record Kafka refused, if any."""
        self.acked = 0
        self._service = service
        self._on_refused = on_refused
        self._lock = threading.Lock()
        self._pending = 0
        self._refusals = 0

    @classmethod
    def connect(cls, settings: KafkaSettings, service: str, on_refused: Callable[[DeliveryFailed], None] | None = None,
                **overrides: Any) -> RecordProducer:
        """A :class:`RecordProducer` over :func:`make_producer`'s producer."""
        return cls(make_producer(settings, **overrides), service, on_refused)

    @property
    def pending(self) -> int:
        """Records queued and not yet reported on."""
        return self._pending

    def produce(self, topic: str, value: bytes | None, key: bytes | None = None, headers: Headers | None = None,
                on_acked: Callable[[], None] | None = None, *, wait_for_room: bool = True,
                on_refused_record: Callable[[DeliveryFailed], None] | None = None) -> bool:
        """Queue one record. When librdkafka's local queue is full, serve delivery
        reports until there is room (backpressure instead of an error), or with
        ``wait_for_room=False`` return ``False`` at once (nothing queued) for a
        caller that must not block (it holds a lock the reports need).

        Exactly one of ``on_acked`` and ``on_refused_record`` runs for a queued
        record, on the thread that serves its delivery report; the latter for
        callers that must settle per-record state on a refusal (``on_refused``
        hears only of the first)."""
        def delivered(err: KafkaError | None, msg: Message) -> None:
            self._delivered(err, msg, on_acked, on_refused_record)

        while True:
            with self._lock:  # counted first: another thread may serve its report before produce() returns
                self._pending += 1
            try:
                self.client.produce(topic, value=value, key=key, headers=headers, on_delivery=delivered)
                return True
            except BufferError:
                with self._lock:
                    self._pending -= 1
                if not wait_for_room:
                    return False
                self.client.poll(0.1)

    def poll(self, timeout: float = 0.0) -> None:
        """Serve delivery reports (runs their callbacks on this thread)."""
        self.client.poll(timeout)

    def flush(self, timeout: float = 60.0) -> None:
        """Wait for every queued record; raise :class:`DeliveryFailed` if any was
        refused or is still unacknowledged after ``timeout`` seconds."""
        self.client.flush(timeout)
        self.check()
        if self._pending:
            raise DeliveryFailed(f"{self._pending} record(s) still unacknowledged by Kafka after {timeout:.0f}s")

    def check(self) -> None:
        """Raise the first refusal, if a record was refused."""
        if self.refused is not None:
            if self._refusals > 1:
                raise DeliveryFailed(f"{self._refusals} records refused; the first: {self.refused}")
            raise self.refused

    def _delivered(self, err: KafkaError | None, msg: Message, on_acked: Callable[[], None] | None,
                   on_refused_record: Callable[[DeliveryFailed], None] | None) -> None:
        with self._lock:
            self._pending -= 1
        if err is None:
            self.acked += 1
            produced_records.labels(self._service, msg.topic(), "acked").inc()
            if on_acked is not None:
                on_acked()
            return
        produced_records.labels(self._service, msg.topic(), "refused").inc()
        key = msg.key()
        shown = key.decode("utf-8", "replace") if key else None
        refusal = DeliveryFailed(f"Kafka refused a record for {msg.topic()} (key {shown}): {err.str()}")
        self._refusals += 1
        if self.refused is None:
            self.refused = refusal
            log.error("%s", refusal)
            if self._on_refused is not None:
                self._on_refused(refusal)
        if on_refused_record is not None:
            on_refused_record(refusal)
