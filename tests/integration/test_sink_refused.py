"""A sink whose records Kafka refuses (a topic deleted under it, auto-creation
off): ready events, or a dead letter. The sink must not count them as sent. It
exits 1 and commits nothing past the first undelivered record; once the topic is
back, a restarted sink announces every stored sample (and dead-letters what it
must)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from confluent_kafka.admin import AdminClient

from hsx.local.commands import sink_command
from hsx.local.spawn import HsxService, cpu_engine_env
from hsx.local.topics import fresh_topics
from hsx.runtime.kafka import ensure_topics
from hsx.runtime.kafka.config import client_config
from tests.drain import drain
from hsx.runtime.settings import KafkaSettings, TopicSettings
from hsx.schemas import HiddenStatesReady
from tests.reliability.harness import committed, dead_letters, index_counts, publish, wait_until
from tests.unit.test_assembler import records

pytestmark = [pytest.mark.integration]

GROUP = "s-refused"
METADATA_MAX_AGE_S = 1.0
NO_AUTO_CREATE = json.dumps({"allow.auto.create.topics": "false", "topic.metadata.propagation.max.ms": "1000",
                             "metadata.max.age.ms": str(int(METADATA_MAX_AGE_S * 1000))})
"""The sink's librdkafka settings. A short metadata age because the embedded broker
(tansu) acknowledges a record for a deleted topic, and drops it, when the producer
sends it on metadata cached before the deletion; a producer's first metadata answer
may list every topic, the deleted one included. Kafka refuses such a record (unknown
topic); for tansu to refuse it too, the sink's cache must have forgotten the topic."""


def _publish_samples(kafka: KafkaSettings, topic: str, ids: list[str]) -> int:
    return publish(kafka, topic, [r for request_id in ids for r in records(request_id)[0]])


def _sink(kafka: KafkaSettings, topics: TopicSettings, output: Path, log_dir: Path, name: str,
          idle: float = 5) -> HsxService:
    command = sink_command(kafka.bootstrap, topics, output, "--exit-when-idle", str(idle), "--flush-when-idle", "0.5",
                           group=GROUP)
    return HsxService(name, command, log_dir, env=cpu_engine_env(HSX_KAFKA_CLIENT_PROPERTIES=NO_AUTO_CREATE))


def _ready_ids(kafka: KafkaSettings, topics: TopicSettings, expected: int) -> list[str]:
    return [HiddenStatesReady.model_validate_json(r.value()).request_id
            for r in drain(kafka, topics.ready, expected=expected)]


@pytest.mark.parametrize("refused", ["ready", "blocks_dlq"])
def test_a_refused_record_stops_the_sink_and_its_restart_redoes_the_work(
        kafka: KafkaSettings, tmp_path: Path, refused: str) -> None:
    topics = fresh_topics(kafka, partitions=1)
    gone = getattr(topics, refused)
    output = tmp_path / "dataset"
    first, second = [f"a-{i}" for i in range(10)], [f"b-{i}" for i in range(10)]
    first_records = _publish_samples(kafka, topics.blocks, first)
    with _sink(kafka, topics, output, tmp_path, "sink-1") as sink:
        assert sink.wait(120) == 0, sink.log_tail()
    assert sorted(_ready_ids(kafka, topics, 10)) == sorted(first)
    assert committed(kafka, topics.blocks, GROUP, 1)[0] == first_records

    with _sink(kafka, topics, output, tmp_path, "sink-2", idle=60) as sink:
        sink.wait_ready(120)
        admin = AdminClient(client_config(kafka))
        admin.delete_topics([gone])[gone].result(30)
        wait_until(lambda: gone not in admin.list_topics(timeout=10).topics, 30, f"{gone} to go")
        time.sleep(2 * METADATA_MAX_AGE_S)  # the sink's cached metadata of the topic has expired
        if refused == "blocks_dlq":  # a record to dead-letter first: nothing after it is committable
            publish(kafka, topics.blocks, [(b"bad-1", b"not a block record")])
        _publish_samples(kafka, topics.blocks, second)
        assert sink.wait(120) == 1, sink.log_tail()
        log = sink.log_tail()
    assert f"Kafka refused a record for {gone}" in log, log
    assert set(index_counts(output)) <= set(first + second)
    assert committed(kafka, topics.blocks, GROUP, 1)[0] == first_records, "committed past an undelivered record"

    ensure_topics(kafka, TopicSettings(partitions=1), [gone])
    with _sink(kafka, topics, output, tmp_path, "sink-3") as sink:
        assert sink.wait(120) == 0, sink.log_tail()
    if refused == "ready":
        assert sorted(_ready_ids(kafka, topics, 10)) == sorted(second)
    else:  # the restart dead-letters the bad record; every sample is announced (some maybe twice: same event id)
        [(headers, record)] = dead_letters(kafka, topics.blocks_dlq, expected=1)
        assert record.key() == b"bad-1" and headers.error_class == "invalid_record"
        assert set(_ready_ids(kafka, topics, 20)) == set(first + second)
    counts = index_counts(output)
    assert set(counts) == set(first + second) and max(counts.values()) == 1
