"""``hsx sink`` against a dataset that already holds many samples, on a real
broker: a retry of a request stored 100 k samples earlier is dropped and
re-announced, another prompt under a stored id is dead-lettered; and a blocks
topic whose partition count grew since the dataset was written is refused."""

from __future__ import annotations

from pathlib import Path

from confluent_kafka import KafkaError, KafkaException
from confluent_kafka.admin import AdminClient, NewPartitions, NewTopic

from hsx.local.commands import sink_command
from hsx.local.datasets import write_tiny_dataset
from hsx.local.spawn import HsxService
from hsx.local.topics import fresh_topics
from hsx.runtime.kafka.config import client_config
from tests.drain import drain
from hsx.dataset.shards import INDEX, shard_stem
from hsx.dataset.storage import LocalStorage
from hsx.runtime.settings import KafkaSettings, TopicSettings
from hsx.schemas import HiddenStatesReady, ShardIndex
from tests.reliability.harness import dead_letters, index_counts, publish
from tests.unit.test_assembler import records

import time

import pytest

pytestmark = [pytest.mark.integration]

STORED = 100_000


def run_sink(kafka: KafkaSettings, topics: TopicSettings, output: Path, log_dir: Path, name: str,
             *extra: str) -> HsxService:
    """``hsx sink`` (with ``extra`` flags) until idle; returns the finished service."""
    command = sink_command(kafka.bootstrap, topics, output, "--exit-when-idle", "5", "--flush-when-idle", "0.5",
                           *extra)
    sink = HsxService(name, command, log_dir)
    with sink:
        sink.wait(180)
    return sink


def grow(kafka: KafkaSettings, topic: str, partitions: int) -> None:
    """Give ``topic`` more partitions; a broker without CreatePartitions (the
    embedded one) gets the topic deleted and created again with them, which is
    the same change as far as the dataset is concerned."""
    admin = AdminClient(client_config(kafka))
    try:
        admin.create_partitions([NewPartitions(topic, partitions)])[topic].result(30)
    except KafkaException as exc:
        if exc.args[0].code() != KafkaError._UNSUPPORTED_FEATURE:
            raise
        admin.delete_topics([topic])[topic].result(30)
        deadline = time.monotonic() + 30
        while True:  # the deletion may take a moment to be final
            try:
                admin.create_topics([NewTopic(topic, partitions, 1)])[topic].result(30)
                break
            except KafkaException as again:
                if again.args[0].code() != KafkaError.TOPIC_ALREADY_EXISTS or time.monotonic() > deadline:
                    raise
                time.sleep(0.5)
    for _ in range(150):  # metadata shows the new count within moments
        if len(admin.list_topics(topic, timeout=10).topics[topic].partitions) == partitions:
            return
        time.sleep(0.2)
    raise AssertionError(f"{topic} never showed {partitions} partitions")


def test_a_retry_of_a_request_stored_100k_samples_earlier_is_dropped(kafka: KafkaSettings, tmp_path: Path) -> None:
    topics = fresh_topics(kafka, partitions=1)
    output = tmp_path / "dataset"
    storage = LocalStorage(output)
    # 100 k samples (1 token each, token id 0) in 10 shards, at offsets the topic's records will not name.
    write_tiny_dataset(storage, topics.blocks, 0, [f"old-{i}" for i in range(STORED)], first_offset=1_000,
                       dataset=output.name)
    first = ShardIndex.model_validate_json((output / INDEX / f"{shard_stem(topics.blocks, 0, 1_000)}.json").read_bytes())
    stored_event = next(e for e in first.events if e.request_id == "old-0")

    retry, _ = records("old-0", tokens=1)  # token ids [0]: the stored prompt again
    conflicting, _ = records("old-54321", tokens=2, first_offset=len(retry))  # [0, 1]: another prompt
    new, _ = records("new-0", tokens=3, first_offset=len(retry) + len(conflicting))
    publish(kafka, topics.blocks, retry + conflicting + new)
    sink = run_sink(kafka, topics, output, tmp_path, "sink")
    assert sink.exited() == 0, sink.log_tail()

    ready = {e.request_id: e for e in (HiddenStatesReady.model_validate_json(r.value())
                                       for r in drain(kafka, topics.ready, expected=2))}
    assert set(ready) == {"old-0", "new-0"}
    assert ready["old-0"] == stored_event  # re-announced as stored, 100 k samples back
    (letter, record), = dead_letters(kafka, topics.blocks_dlq, expected=1)
    assert letter.error_class == "conflicting_duplicate" and record.key() == b"old-54321"
    counts = index_counts(output)
    assert len(counts) == STORED + 1 and max(counts.values()) == 1
    assert "1 duplicates dropped" in sink.logs()


def test_a_grown_blocks_topic_is_refused(kafka: KafkaSettings, tmp_path: Path) -> None:
    topics = fresh_topics(kafka, partitions=1)
    output = tmp_path / "dataset"
    publish(kafka, topics.blocks, records("before", tokens=2)[0])
    first = run_sink(kafka, topics, output, tmp_path, "first")
    assert first.exited() == 0, first.log_tail()
    assert index_counts(output) == {"before": 1}

    grow(kafka, topics.blocks, 2)
    publish(kafka, topics.blocks, records("after", tokens=2)[0])
    second = run_sink(kafka, topics, output, tmp_path, "second")
    assert second.exited() == 1, second.log_tail()
    error = [line for line in second.logs().splitlines() if "hsx sink:" in line]
    assert len(error) == 1, second.log_tail()
    assert f"written from {topics.blocks} with 1 partitions, but {topics.blocks} now has 2" in error[0]
    assert "Write to a new --output" in error[0]
    assert index_counts(output) == {"before": 1}  # nothing was written meanwhile
