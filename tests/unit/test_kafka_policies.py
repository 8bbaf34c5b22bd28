"""The Kafka layer's error paths that the embedded broker will not produce on
demand: a commit answered with one failed partition, a commit that fails whole,
each kind of consumer error, a transaction that cannot commit (mocks: error
paths only), and prompts refused by an unreachable cluster."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import pytest
from confluent_kafka import KafkaError, KafkaException, TopicPartition

from hsx.producer.publisher import Publisher
from hsx.producer.sources import SourceLine
from hsx.runtime.kafka import ConsumerErrors, DeliveryFailed, KafkaFatal, RecordProducer
from hsx.runtime.kafka.commits import commit_watermarks
from hsx.runtime.kafka.watermarks import Watermarks
from hsx.runtime.settings import KafkaSettings, TopicSettings
from hsx.sink.ready import ReadyPublisher
from tests.integration.test_group_member import _ready_event


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


class _TransactionalClient:
    """A transactional producer whose commit fails (a fenced producer, a broker
    that aborted the transaction on its own)."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def init_transactions(self, timeout: float) -> None:
        self.calls.append("init")

    def begin_transaction(self) -> None:
        self.calls.append("begin")

    def produce(self, topic: str, **_: object) -> None:
        self.calls.append("produce")

    def send_offsets_to_transaction(self, offsets: object, metadata: object) -> None:
        self.calls.append("offsets")

    def commit_transaction(self, timeout: float) -> None:
        raise KafkaException(KafkaError(KafkaError._FENCED, "producer fenced"))

    def abort_transaction(self, timeout: float) -> None:
        self.calls.append("abort")


class _GroupConsumer:
    def consumer_group_metadata(self) -> object:
        return object()


def test_a_failed_transaction_is_aborted_and_nothing_more_is_committed(monkeypatch: pytest.MonkeyPatch) -> None:

    client = _TransactionalClient()
    monkeypatch.setattr(RecordProducer, "connect", classmethod(lambda cls, *a, **k: cls(client, "sink")))  # type: ignore[arg-type]
    marks = Watermarks()
    marks.track(("blocks", 0), 0)
    publisher = ReadyPublisher(KafkaSettings(), RecordProducer(client, "sink"), "ready", marks,  # type: ignore[arg-type]
                               transactional_id="sink")
    publisher.bind(_GroupConsumer())  # type: ignore[arg-type]
    with pytest.raises(DeliveryFailed, match="transaction not committed .*producer fenced"):
        publisher.publish([_ready_event("r-1")], lambda: marks.done(("blocks", 0), 0))
    assert client.calls[-2:] == ["offsets", "abort"]
    assert marks.to_commit() == {("blocks", 0): 1}  # never marked committed
    calls = len(client.calls)
    publisher.commit()  # the member's periodic commit: nothing after the failure
    with pytest.raises(DeliveryFailed):
        publisher.publish([_ready_event("r-2")], lambda: None)
    assert len(client.calls) == calls


def test_a_one_shot_publish_reports_refused_prompts() -> None:

    producer = RecordProducer.connect(KafkaSettings(bootstrap="127.0.0.1:1"), "producer",
                                      **{"delivery.timeout.ms": 1000})
    publisher = Publisher(producer, TopicSettings().topics())
    lines = [SourceLine("in.jsonl", i + 1, f'{{"request_id": "r-{i}", "prompt": "hi"}}'.encode()) for i in range(3)]
    with pytest.raises(DeliveryFailed, match=r"3 records refused; the first: Kafka refused a record for prompts"):
        publisher.publish(lines)
