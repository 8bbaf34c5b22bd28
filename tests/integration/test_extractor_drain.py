"""SIGTERM drains: the extractor stops fetching, finishes what is in flight,
commits only finished work and leaves; a restart picks up exactly the rest."""

from __future__ import annotations

import time
import uuid
from pathlib import Path

import orjson
import pytest
from confluent_kafka import Consumer, Producer, TopicPartition

from hsx import models
from hsx.local.commands import extract_command
from hsx.local.scrape import get, metric
from hsx.local.spawn import HsxService
from hsx.local.topics import fresh_topics
from hsx.runtime.kafka import consumer_config
from hsx.runtime.settings import KafkaSettings
from tests.engine_helpers import reassemble, run_extractor
from tests.drain import drain

pytestmark = [pytest.mark.integration, pytest.mark.engine]

PROMPTS = 120


def _committed(kafka: KafkaSettings, topic: str, group: str) -> dict[int, int]:
    consumer = Consumer({"bootstrap.servers": kafka.bootstrap, "group.id": group})
    try:
        return {tp.partition: tp.offset for tp in consumer.committed([TopicPartition(topic, p) for p in range(2)], timeout=10)}
    finally:
        consumer.close()


def _wait_for_first_record(kafka: KafkaSettings, topic: str, timeout: float = 300) -> None:
    consumer = Consumer(consumer_config(kafka, f"watch-{uuid.uuid4().hex}", **{"session.timeout.ms": 6000}))
    consumer.subscribe([topic])
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            msg = consumer.poll(0.2)
            if msg is not None and msg.error() is None:
                return
        raise AssertionError("the extractor produced nothing")
    finally:
        consumer.close()


def _wait_for_prompts_above(health_port: int, floor: float, timeout: float = 60) -> float:
    """The extractor's acknowledged-prompt count once it exceeds `floor`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done = metric(health_port, "hsx_extractor_prompts_total")
        if done > floor:
            return done
        time.sleep(0.2)
    raise AssertionError(f"hsx_extractor_prompts_total did not pass {floor} within {timeout:.0f}s")


def test_sigterm_drains_and_restart_finishes(kafka: KafkaSettings, tmp_path: Path) -> None:
    model = models.prepare(names=["tiny-llama"])["tiny-llama"]
    topics = fresh_topics(kafka, partitions=2)
    group = f"g-{topics.prompts}"
    producer = Producer({"bootstrap.servers": kafka.bootstrap})
    for i in range(PROMPTS):
        words = " ".join(f"w{(i * 13 + k) % 97}" for k in range(150 + i % 50))
        producer.produce(topics.prompts, key=f"d-{i}".encode(), value=orjson.dumps({"request_id": f"d-{i}", "prompt": words}))
    assert producer.flush(30) == 0

    command = extract_command(kafka.bootstrap, topics, model, "--max-model-len", "1024", "--max-inflight", "4",
                              group=group)
    with HsxService("first", command, tmp_path) as extractor:
        health_port = extractor.port
        _wait_for_first_record(kafka, topics.blocks)
        assert get(health_port, "/readyz")[0] == 200
        # The counter moves when Kafka acknowledges a prompt's manifest, which can come
        # well after its first block record is readable: wait for one, then another.
        first = _wait_for_prompts_above(health_port, 0)
        _wait_for_prompts_above(health_port, first)
        assert extractor.stop(timeout=120) == 0, (tmp_path / "first.log").read_text()[-3000:]  # SIGTERM: a drain

    committed = _committed(kafka, topics.prompts, group)
    samples = reassemble(drain(kafka, topics.blocks, expected=1, timeout=20, settle=3.0))
    prompts = {r.key().decode(): (r.partition(), r.offset()) for r in drain(kafka, topics.prompts, expected=PROMPTS)}
    # Nothing committed that has no complete sample on the blocks topic.
    for request_id, (partition, offset) in prompts.items():
        if offset < committed[partition]:
            assert request_id in samples, f"{request_id} committed without its records"
    assert len(samples) < PROMPTS, "the run finished before SIGTERM; the test proved nothing"

    result = run_extractor(kafka.bootstrap, topics, group, model, tmp_path / "second.log", "--max-model-len", "1024")
    assert result == 0, (tmp_path / "second.log").read_text()[-3000:]
    samples = reassemble(drain(kafka, topics.blocks, expected=1, timeout=20, settle=3.0))
    assert set(samples) == set(prompts)  # nothing lost; duplicates only from the drain boundary
    ends = {p: max(o for q, o in prompts.values() if q == p) + 1 for p in range(2)}
    assert _committed(kafka, topics.prompts, group) == ends
