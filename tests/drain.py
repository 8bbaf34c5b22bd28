"""Reading a whole topic with a throw-away consumer group: for tests' checks,
never for the services' own loops."""

from __future__ import annotations

import time
import uuid

from confluent_kafka import Consumer, KafkaException, Message

from hsx.runtime.kafka.config import consumer_config
from hsx.runtime.settings import KafkaSettings


def drain(kafka: KafkaSettings, topic: str, expected: int, timeout: float = 60.0, settle: float = 1.0) -> list[Message]:
    """Read a topic from the beginning until ``expected`` records arrived (then
    ``settle`` seconds more, to catch extras) or ``timeout`` passed."""
    consumer = Consumer(
        consumer_config(kafka, group_id=f"hsx-drain-{uuid.uuid4().hex}", **{"session.timeout.ms": 6000})
    )
    consumer.subscribe([topic])
    records: list[Message] = []
    deadline = time.monotonic() + timeout
    settle_until: float | None = None
    try:
        while time.monotonic() < deadline:
            if settle_until is not None and time.monotonic() > settle_until:
                break
            msg = consumer.poll(0.2)
            if msg is None:
                continue
            if msg.error() is not None:
                raise KafkaException(msg.error())
            records.append(msg)
            if len(records) >= expected and settle_until is None:
                settle_until = time.monotonic() + settle
    finally:
        consumer.close()
    return records
