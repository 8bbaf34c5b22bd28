"""How long the sink's loop waits for records: at most ``POLL_S`` when there is
nothing else to do, ``BUSY_POLL_S`` while a shard is being written or ready
events await Kafka's acknowledgement, and never past the moment an open shard
falls due (so neither a due shard nor a landed one waits on a whole poll)."""

from __future__ import annotations

import time
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import pytest

from hsx.local.datasets import tiny_sample
from hsx.runtime.kafka import RecordProducer
from hsx.runtime.kafka.dead_letters import DeadLetters
from hsx.runtime.settings import KafkaSettings, TopicSettings
from hsx.sink.options import SinkOptions
from hsx.sink.partition import PartitionState
from hsx.sink.service import BUSY_POLL_S, POLL_S, Sink


@pytest.fixture
def sink(tmp_path: Path, request: pytest.FixtureRequest) -> Sink:
    options: dict[str, Any] = getattr(request, "param", {})
    kafka = KafkaSettings(bootstrap="localhost:1")  # never reached: nothing here needs a broker
    sink = Sink(kafka, TopicSettings(), SinkOptions(output=str(tmp_path), max_shard_age=60, **options))
    sink._dead_letters = DeadLetters(RecordProducer.connect(kafka, "sink"), "sink")  # run() makes it
    sink._recorded_partitions = 1
    sink.assigned([(sink.topics.blocks, 0)])
    return sink


def partition(sink: Sink) -> PartitionState:
    return sink._partitions[(sink.topics.blocks, 0)]


def test_an_idle_sink_waits_the_whole_poll(sink: Sink) -> None:
    assert sink._poll_timeout() == POLL_S
    partition(sink).shard.add(tiny_sample("young", 0))  # due in a minute
    assert sink._poll_timeout() == POLL_S


def test_the_wait_ends_when_an_open_shard_falls_due(sink: Sink) -> None:
    shard = partition(sink).shard
    shard.add(tiny_sample("old", 0))
    shard.opened_at = time.monotonic() - 59.95
    assert 0 < sink._poll_timeout() <= 0.05
    shard.opened_at = time.monotonic() - 61  # overdue: no wait at all
    assert sink._poll_timeout() == 0


@pytest.mark.parametrize("sink", [{"flush_when_idle": 1.0}], indirect=True)
def test_the_wait_ends_when_an_open_shard_has_been_idle_long_enough(sink: Sink) -> None:
    shard = partition(sink).shard
    shard.add(tiny_sample("idle", 0))
    shard.last_added_at = time.monotonic() - 0.9
    assert 0 < sink._poll_timeout() <= 0.1


def test_a_shard_being_written_shortens_the_wait(sink: Sink) -> None:
    state = partition(sink)
    state.writing = Future()  # under way: it lands any moment, and its ready events should follow at once
    assert sink._poll_timeout() == BUSY_POLL_S
    state.writing = None
    assert sink._poll_timeout() == POLL_S


def test_unacknowledged_ready_events_shorten_the_wait(sink: Sink) -> None:
    sink._dead_letters.producer.produce(sink.topics.ready, b"{}")  # the broker is unreachable: never acknowledged
    assert sink._poll_timeout() == BUSY_POLL_S
