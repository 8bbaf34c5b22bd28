"""``hsx demo``: the whole pipeline on a small bundled prompt mix.

Today it runs producer → broker → consumer and checks the round trip; the
extractor and sink stages join as they land.
"""

from __future__ import annotations

import argparse
import sys
import time
from importlib import resources

from confluent_kafka import Consumer

from producer.publisher import Mapping, Publisher
from producer.sources import read_jsonl
from runtime.broker import dev_bootstrap
from runtime.kafka import DeliveryTracker, consumer_config, ensure_topics, make_producer
from runtime.settings import KafkaSettings, TopicSettings
from schemas import PromptEvent

DEMO_PROMPTS = "demo_prompts.jsonl"


def run(args: argparse.Namespace) -> int:
    with dev_bootstrap() as bootstrap:
        kafka = KafkaSettings(bootstrap=bootstrap)
        topic_settings = TopicSettings()
        topics = topic_settings.topics()
        ensure_topics(kafka, topic_settings, [topics.prompts, topics.prompts_dlq])

        data = resources.files("hsx") / "data" / DEMO_PROMPTS
        with data.open("rb") as stream:
            publisher = Publisher(DeliveryTracker(make_producer(kafka)), topics, Mapping())
            summary = publisher.publish(read_jsonl(stream, DEMO_PROMPTS))
        print(f"producer: {summary.describe()}")

        received = _consume_all(kafka, topics.prompts, expected=summary.sent)
        print(f"consumer: read back {len(received)} distinct prompt events from {bootstrap}")
        if len(received) != summary.sent:
            print("demo FAILED: the round trip lost or doubled events", file=sys.stderr)
            return 1
    print(
        "demo: producer → broker → consumer round trip OK. "
        "The extractor and sink stages are not implemented yet; the demo stops here."
    )
    return 0


def _consume_all(kafka: KafkaSettings, topic: str, expected: int, timeout: float = 60.0) -> dict[str, PromptEvent]:
    consumer = Consumer(consumer_config(kafka, group_id=f"hsx-demo-{time.time_ns()}", **{"session.timeout.ms": 6000}))
    consumer.subscribe([topic])
    events: dict[str, PromptEvent] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(events) < expected and time.monotonic() < deadline:
            msg = consumer.poll(0.5)
            if msg is None or msg.error():
                continue
            event = PromptEvent.model_validate_json(msg.value())
            events[event.request_id] = event
    finally:
        consumer.close()
    return events
