"""SIGTERM drains: the extractor stops fetching, finishes what is in flight,
commits only finished work and leaves; a restart picks up exactly the rest."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import orjson
import pytest
from confluent_kafka import Consumer, Producer, TopicPartition

from hsx import models
from runtime.kafka import consumer_config, ensure_topics
from runtime.settings import KafkaSettings, TopicSettings
from hsx.demo import cpu_engine_env
from runtime.broker import free_port
from tests.http_helpers import get, metric
from tests.engine_helpers import reassemble, run_extractor
from runtime.kafka.drain import drain

pytestmark = [pytest.mark.integration, pytest.mark.engine]

PROMPTS = 240


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


def test_sigterm_drains_and_restart_finishes(kafka: KafkaSettings, tmp_path: Path) -> None:
    model = models.prepare(names=["tiny-llama"])["tiny-llama"]
    suffix = uuid.uuid4().hex[:8]
    topics = {"prompts": f"p-{suffix}", "blocks": f"b-{suffix}", "prompts_dlq": f"d-{suffix}", "group": f"g-{suffix}"}
    ensure_topics(kafka, TopicSettings(partitions=2), [topics["prompts"], topics["blocks"], topics["prompts_dlq"]])
    producer = Producer({"bootstrap.servers": kafka.bootstrap})
    for i in range(PROMPTS):
        words = " ".join(f"w{(i * 13 + k) % 97}" for k in range(150 + i % 50))
        producer.produce(topics["prompts"], key=f"d-{i}".encode(), value=orjson.dumps({"request_id": f"d-{i}", "prompt": words}))
    assert producer.flush(30) == 0

    health_port = free_port()
    cmd = [sys.executable, "-m", "hsx.cli", "extract", "--bootstrap", kafka.bootstrap, "--topic", topics["prompts"],
           "--blocks-topic", topics["blocks"], "--dlq-topic", topics["prompts_dlq"], "--group", topics["group"],
           "--model", str(model), "--dtype", "float32", "--enforce-eager", "--max-model-len", "1024",
           "--session-timeout-ms", "6000", "--max-inflight", "4", "--health-port", str(health_port)]
    with (tmp_path / "first.log").open("wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=cpu_engine_env())
        try:
            _wait_for_first_record(kafka, topics["blocks"])
            assert get(health_port, "/readyz")[0] == 200
            first, second = metric(health_port, "hsx_extractor_prompts_total"), None
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and (second is None or second <= first):
                time.sleep(0.2)
                second = metric(health_port, "hsx_extractor_prompts_total")
            assert first > 0 and second is not None and second > first, "hsx_extractor_prompts_total did not move"
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=120) == 0, (tmp_path / "first.log").read_text()[-3000:]
        finally:
            proc.kill()

    committed = _committed(kafka, topics["prompts"], topics["group"])
    samples = reassemble(drain(kafka, topics["blocks"], expected=1, timeout=20, settle=3.0))
    prompts = {r.key().decode(): (r.partition(), r.offset()) for r in drain(kafka, topics["prompts"], expected=PROMPTS)}
    # Nothing committed that has no complete sample on the blocks topic.
    for request_id, (partition, offset) in prompts.items():
        if offset < committed[partition]:
            assert request_id in samples, f"{request_id} committed without its records"
    assert len(samples) < PROMPTS, "the run finished before SIGTERM; the test proved nothing"

    result = run_extractor(kafka.bootstrap, topics, model, tmp_path / "second.log", "--max-model-len", "1024")
    assert result.returncode == 0, (tmp_path / "second.log").read_text()[-3000:]
    samples = reassemble(drain(kafka, topics["blocks"], expected=1, timeout=20, settle=3.0))
    assert set(samples) == set(prompts)  # nothing lost; duplicates only from the drain boundary
    ends = {p: max(o for q, o in prompts.values() if q == p) + 1 for p in range(2)}
    assert _committed(kafka, topics["prompts"], topics["group"]) == ends
