"""ReadyStream against a real broker: ready events published as the sink
publishes them, for a dataset written through the sink's own write path."""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from collections import Counter
from pathlib import Path

import pytest
import torch
from confluent_kafka import Producer
from torch.utils.data import DataLoader

from hsx.dataset.reader import MissingShard
from hsx.dataset.storage import open_storage
from hsx.local.topics import fresh_topic_settings
from hsx.local.training_data import TrainingDataSpec, write_training_dataset
from hsx.runtime.kafka import ensure_topics, producer_config
from hsx.runtime.settings import KafkaSettings
from hsx.schemas import HiddenStatesReady
from hsx.trainer import PaddedCollate, ReadyStream
from hsx.trainer.consume import my_partitions
from tests.integration.online_trainer import BATCH

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]


def _publish(kafka: KafkaSettings, events: list[HiddenStatesReady], partitions: int) -> str:
    """A fresh ready topic holding ``events``, event i in partition ``i % partitions``."""
    settings = fresh_topic_settings(partitions=partitions)
    ensure_topics(kafka, settings, [settings.ready])
    producer = Producer(producer_config(kafka))
    for i, event in enumerate(events):
        producer.produce(settings.ready, event.model_dump_json().encode(), key=event.request_id.encode(),
                         partition=i % partitions)
    assert producer.flush(60) == 0
    return settings.ready


def test_two_ranks_by_two_workers_deliver_every_event_once(tmp_path: Path, kafka: KafkaSettings) -> None:
    events = write_training_dataset(tmp_path / "ds", TrainingDataSpec(samples=30), partitions=3)
    topic = _publish(kafka, events, partitions=5)  # 5 partitions over 4 slots: one slot reads two
    group = f"job-{uuid.uuid4().hex}"
    delivered: list[tuple[int, str, int]] = []
    for rank in (0, 1):
        stream = ReadyStream(kafka.bootstrap, tmp_path / "ds", group, topic=topic, rank=rank, world_size=2,
                             shuffle_buffer=4, until_end=True)
        loader = DataLoader(stream, batch_size=3, num_workers=2, collate_fn=PaddedCollate(torch.float32))
        for batch in loader:
            delivered += [(rank, rid, pos.partition) for rid, pos in zip(batch["request_ids"], batch["positions"])]
            stream.commit(batch)
        stream.close()
    assert sorted(rid for _, rid, _ in delivered) == sorted(e.request_id for e in events)
    for rank in (0, 1):  # each rank read only its own workers' partitions
        own = {p for w in (0, 1) for p in my_partitions(list(range(5)), rank * 2 + w, 4)}
        assert {p for r, _, p in delivered if r == rank} == own


def _run_trainer(kafka: KafkaSettings, dataset: Path, topic: str, group: str, log: Path,
                 *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "tests.integration.online_trainer", kafka.bootstrap, str(dataset),
                           topic, group, str(log), *extra], cwd=ROOT, capture_output=True, text=True, timeout=600,
                          check=False)


@pytest.mark.parametrize("shuffle, resume", [(0, "kafka"), (6, "state")])
def test_kill_between_batches_loses_nothing(tmp_path: Path, kafka: KafkaSettings, shuffle: int, resume: str) -> None:
    """Killed after a batch's step and before its commit, then restarted: every
    sample is trained on, and only the uncommitted batch's come twice. In order
    (no shuffle) the Kafka commit alone gives that; with a shuffle buffer the
    checkpointed state does (it also skips what was consumed out of order)."""
    events = write_training_dataset(tmp_path / "ds", TrainingDataSpec(samples=40), partitions=2)
    topic = _publish(kafka, events, partitions=2)
    group, log = f"job-{uuid.uuid4().hex}", tmp_path / "trained.jsonl"
    extra = ["--shuffle", str(shuffle), *(["--state", str(tmp_path / "state.json")] if resume == "state" else [])]
    crashed = _run_trainer(kafka, tmp_path / "ds", topic, group, log, *extra, "--crash-after", "3")
    assert crashed.returncode == -9, crashed.stderr[-2000:]
    batches = [json.loads(line) for line in log.read_text().splitlines()]
    assert len(batches) == 3
    finished = _run_trainer(kafka, tmp_path / "ds", topic, group, log, *extra)
    assert finished.returncode == 0, finished.stderr[-2000:]
    trained = Counter(rid for line in log.read_text().splitlines() for rid in json.loads(line))
    assert set(trained) == {e.request_id for e in events}  # none lost
    twice = {rid for rid, n in trained.items() if n > 1}
    assert twice <= set(batches[-1]) and len(twice) <= BATCH and max(trained.values()) == 2


def test_a_ready_event_without_its_shard_fails_clearly(tmp_path: Path, kafka: KafkaSettings) -> None:
    events = write_training_dataset(tmp_path / "ds", TrainingDataSpec(samples=6, per_shard=3), partitions=1)
    (tmp_path / "ds" / events[4].shard).unlink()  # the second shard
    topic = _publish(kafka, events, partitions=1)
    stream = ReadyStream(kafka.bootstrap, tmp_path / "ds", f"job-{uuid.uuid4().hex}", topic=topic, until_end=True)
    loader = DataLoader(stream, batch_size=2, num_workers=1, collate_fn=PaddedCollate(torch.float32))
    got: list[str] = []
    with pytest.raises(MissingShard, match=rf"shard {events[4].shard} is not in the dataset at "):
        for batch in loader:
            got += batch["request_ids"]
    assert got == [e.request_id for e in events[:2]]  # the batches before the missing shard came through


def test_a_second_epoch_of_persistent_workers_reads_only_what_came_since(tmp_path: Path, kafka: KafkaSettings) -> None:
    """Persistent workers keep the stream as it was when they started; the job's
    commits tell them where the first epoch ended."""
    events = write_training_dataset(tmp_path / "ds", TrainingDataSpec(samples=16), partitions=2)
    settings = fresh_topic_settings(partitions=2)
    ensure_topics(kafka, settings, [settings.ready])
    producer = Producer(producer_config(kafka))

    def publish(batch: list[HiddenStatesReady]) -> None:
        for i, event in enumerate(batch):
            producer.produce(settings.ready, event.model_dump_json().encode(), partition=i % 2)
        assert producer.flush(60) == 0

    publish(events[:10])
    group = f"job-{uuid.uuid4().hex}"
    stream = ReadyStream(kafka.bootstrap, tmp_path / "ds", group, topic=settings.ready, shuffle_buffer=3,
                         until_end=True)
    # Resumed from a checkpoint at the start: the workers' copy of that position goes stale in epoch 1.
    stream.load_state_dict({"topic": settings.ready, "group_id": group, "partitions": [
        {"partition": 0, "next_offset": 0}, {"partition": 1, "next_offset": 0}]})
    loader = DataLoader(stream, batch_size=2, num_workers=2, persistent_workers=True,
                        collate_fn=PaddedCollate(torch.float32))
    epochs = []
    for later in (events[10:], []):
        seen = []
        for batch in loader:
            seen += batch["request_ids"]
            stream.commit(batch)
        epochs.append(sorted(seen))
        publish(later)
    stream.close()
    assert epochs == [sorted(e.request_id for e in events[:10]), sorted(e.request_id for e in events[10:])]


def test_a_stream_over_an_s3_dataset_with_forkserver_workers(kafka: KafkaSettings, s3_dataset_url: str) -> None:
    events = write_training_dataset(open_storage(s3_dataset_url), TrainingDataSpec(samples=12), partitions=2)
    topic = _publish(kafka, events, partitions=2)
    stream = ReadyStream(kafka.bootstrap, s3_dataset_url, f"job-{uuid.uuid4().hex}", topic=topic, until_end=True)
    loader = DataLoader(stream, batch_size=4, num_workers=2, collate_fn=PaddedCollate(torch.float32),
                        multiprocessing_context="forkserver")
    delivered = []
    for batch in loader:
        delivered += batch["request_ids"]
        stream.commit(batch)
    stream.close()
    assert sorted(delivered) == sorted(e.request_id for e in events)
