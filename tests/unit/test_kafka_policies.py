"""The Kafka layer's error paths that a real broker will not produce on demand:
a commit answered with one failed partition, a commit that fails whole, and
each kind of consumer error (mocks: error paths only)."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import pytest
from confluent_kafka import KafkaError, KafkaException, TopicPartition

from runtime.kafka import ConsumerErrors, KafkaFatal
from runtime.kafka.commits import commit_watermarks
from runtime.kafka.watermarks import Watermarks


@dataclass
class _Answer:
    """One partition of a commit's answer (TopicPartition's error is read-only)."""

    topic: str
    partition: int
    offset: int
    error: KafkaError | None = None


class _Consumer:
    """Answers commits as told: per-partition errors, or an exception."""

    def __init__(self, errors: dict[int, KafkaError] | None = None, raises: KafkaException | None = None) -> None:
        self.errors = errors or {}
        self.raises = raises
        self.calls: list[list[TopicPartition]] = []

    def commit(self, offsets: list[TopicPartition], asynchronous: bool) -> list[_Answer]:
        assert asynchronous is False
        self.calls.append(offsets)
        if self.raises is not None:
            raise self.raises
        return [_Answer(tp.topic, tp.partition, tp.offset, self.errors.get(tp.partition)) for tp in offsets]


def _marks() -> Watermarks:
    marks = Watermarks()
    for partition in (0, 1):
        marks.track(("t", partition), 4)
        marks.done(("t", partition), 4)
    return marks


def test_a_partition_whose_commit_failed_is_retried_and_the_others_are_not() -> None:
    marks = _marks()
    consumer = _Consumer({1: KafkaError(KafkaError.REBALANCE_IN_PROGRESS)})
    commit_watermarks(consumer, marks)  # type: ignore[arg-type]
    assert marks.to_commit() == {("t", 1): 5}  # partition 0 is committed, 1 waits for the next commit
    consumer.errors = {}
    commit_watermarks(consumer, marks)  # type: ignore[arg-type]
    assert [(tp.partition, tp.offset) for tp in consumer.calls[-1]] == [(1, 5)]
    assert marks.to_commit() == {}


def test_a_commit_that_fails_whole_leaves_every_position_to_retry() -> None:
    marks = _marks()
    commit_watermarks(_Consumer(raises=KafkaException(KafkaError(KafkaError._TRANSPORT))), marks)  # type: ignore[arg-type]
    assert marks.to_commit() == {("t", 0): 5, ("t", 1): 5}


def test_consumer_errors_end_of_partition_transient_and_fatal(caplog: pytest.LogCaptureFixture) -> None:
    errors = ConsumerErrors("test")
    errors.check(KafkaError(KafkaError._PARTITION_EOF))
    with caplog.at_level(logging.WARNING):
        for _ in range(3):
            errors.check(KafkaError(KafkaError._TRANSPORT, "broker down"))
    assert errors.counts == {"_TRANSPORT": 3}
    assert sum("broker down" in r.getMessage() for r in caplog.records) == 1  # logged once per kind
    with pytest.raises(KafkaFatal, match="fenced"):
        errors.check(KafkaError(KafkaError._FENCED, "fenced", fatal=True))
    with pytest.raises(KafkaFatal):
        errors.check(KafkaError(KafkaError.TOPIC_AUTHORIZATION_FAILED))
