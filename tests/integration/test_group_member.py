"""The consumer-group member both services share, the one dead-letter path, and
the sink's ready-event publisher (plain and transactional), against the real broker."""

from __future__ import annotations

import time
import uuid

import pytest
from confluent_kafka import OFFSET_INVALID, Consumer, TopicPartition

from hsx.runtime.errors import InvalidInput
from hsx.runtime.kafka import DeliveryFailed, RecordProducer, consumer_config, ensure_topics, make_producer
from hsx.runtime.kafka.dead_letters import DeadLetters
from tests.drain import drain
from hsx.runtime.kafka.member import GroupMember
from hsx.runtime.kafka.watermarks import TopicPartitionKey
from hsx.runtime.settings import KafkaSettings, TopicSettings
from hsx.schemas import DlqHeaders, DType, ErrorClass, HiddenStatesReady, TensorNames, ready_event_id
from hsx.sink.ready import ReadyPublisher

pytestmark = pytest.mark.integration


class Recorder:
    """A PartitionHandler that remembers what the member told it, and when."""

    def __init__(self, member_ref: list[GroupMember]) -> None:
        self.calls: list[tuple[str, list[TopicPartitionKey]]] = []
        self._member = member_ref

    def assigned(self, partitions: list[TopicPartitionKey]) -> None:
        self.calls.append(("assigned", partitions))

    def revoked(self, partitions: list[TopicPartitionKey]) -> None:
        # The work of the revoked partitions becomes durable here: the member must
        # commit it right after, before the partitions move on.
        for tp in partitions:
            self._member[0].done(tp, 2)
        self.calls.append(("revoked", partitions))

    def lost(self, partitions: list[TopicPartitionKey]) -> None:
        self.calls.append(("lost", partitions))


def _topic(kafka: KafkaSettings, records: int) -> str:
    topic = f"member-{uuid.uuid4().hex[:8]}"
    ensure_topics(kafka, TopicSettings(partitions=1), [topic])
    producer = make_producer(kafka)
    for i in range(records):
        producer.produce(topic, value=str(i).encode())
    assert producer.flush(30) == 0
    return topic


def _committed(kafka: KafkaSettings, group: str, topic: str) -> int:
    consumer = Consumer(consumer_config(kafka, group))
    try:
        return consumer.committed([TopicPartition(topic, 0)], timeout=10)[0].offset
    finally:
        consumer.close()


def test_member_commits_up_to_the_first_unfinished_record_and_on_revoke(kafka: KafkaSettings) -> None:
    topic, group = _topic(kafka, 6), f"g-{uuid.uuid4().hex[:8]}"
    ref: list[GroupMember] = []
    handler = Recorder(ref)
    member = GroupMember(kafka, group, topic, "test_member", handler,
                         consumer_overrides={"session.timeout.ms": 6000}, commit_interval=3600)
    ref.append(member)
    member.subscribe()
    seen = []
    deadline = time.monotonic() + 30
    while len(seen) < 6 and time.monotonic() < deadline:
        seen += member.poll(10, timeout=0.2)
    assert [m.offset() for m in seen] == list(range(6))
    assert handler.calls == [("assigned", [(topic, 0)])]

    for offset in (0, 1, 3, 4, 5):  # offset 2 is still being worked on
        member.done((topic, 0), offset)
    member.commit()
    assert _committed(kafka, group, topic) == 2

    member.close()  # leaving the group revokes: the handler finishes offset 2, the member commits it
    assert handler.calls[-1] == ("revoked", [(topic, 0)])
    assert _committed(kafka, group, topic) == 6


def test_a_caller_that_stops_early_leaves_the_rest_to_the_next_poll(kafka: KafkaSettings) -> None:
    """The sink stops taking records once its memory budget is full: what it did
    not take is neither tracked nor lost, and the next poll starts there."""
    topic, group = _topic(kafka, 8), f"g-{uuid.uuid4().hex[:8]}"
    member = GroupMember(kafka, group, topic, "test_member", consumer_overrides={"session.timeout.ms": 6000})
    member.subscribe()
    try:
        taken = []
        deadline = time.monotonic() + 30
        while len(taken) < 3 and time.monotonic() < deadline:
            for message in member.poll(100, timeout=0.2):
                taken.append(message)
                if len(taken) == 3:
                    break
        assert [m.offset() for m in taken] == [0, 1, 2]
        assert member.marks.in_flight() == 3  # only what was taken is tracked
        while len(taken) < 8 and time.monotonic() < deadline:
            taken += member.poll(100, timeout=0.2)
        assert [m.offset() for m in taken] == list(range(8))
    finally:
        member.close()


def test_member_stops_when_idle_since_joining_but_not_while_busy(kafka: KafkaSettings) -> None:
    """Joining is start-up, not idleness: a member that waits longer than its idle
    time for its first assignment (Kafka waits for a group's members to rejoin)
    must not leave before it got any work. Busy is not idle either."""
    member = GroupMember(kafka, f"g-{uuid.uuid4().hex[:8]}", _topic(kafka, 0), "test_member",
                         consumer_overrides={"session.timeout.ms": 6000}, exit_when_idle=2.0)
    member.subscribe()
    try:
        time.sleep(2.2)
        member.tick()  # not polled yet, so not joined: callbacks run only inside poll
        assert not member.stopping
        deadline = time.monotonic() + 30
        while not member.assignment and time.monotonic() < deadline:
            list(member.poll(10, 0.1))
        assert member.assignment
        member.tick()
        assert not member.stopping
        time.sleep(2.2)
        member.tick(busy=True)
        assert not member.stopping
        time.sleep(2.2)
        member.tick()
        assert member.stopping
    finally:
        member.close()


def test_dead_letters_carry_the_rejection_and_count_as_done_when_acked(kafka: KafkaSettings) -> None:
    topic = _topic(kafka, 0)
    letters = DeadLetters(RecordProducer.connect(kafka, "extractor"), "extractor")
    acked: list[bool] = []
    letters.send(topic, InvalidInput(ErrorClass.PROMPT_TOO_LONG, "900 tokens; at most 511 fit"), b"original", b"r-1",
                 lambda: acked.append(True), source_topic="prompts", source_partition=1, source_offset=7)
    letters.producer.flush(30)
    assert acked == [True]
    letters.producer.check()
    [record] = drain(kafka, topic, expected=1)
    headers = DlqHeaders.from_kafka(record.headers())
    assert (record.value(), record.key()) == (b"original", b"r-1")
    assert headers.error_class is ErrorClass.PROMPT_TOO_LONG and headers.source_offset == 7
    assert headers.service == "extractor" and "900 tokens" in headers.error_message


def test_a_refused_dead_letter_is_fatal() -> None:
    """The documented policy: the service is told at once and must stop without
    committing the record behind the letter."""
    refused: list[DeliveryFailed] = []
    producer = RecordProducer.connect(KafkaSettings(bootstrap="127.0.0.1:1"), "sink", refused.append,
                                      **{"delivery.timeout.ms": 1000})
    letters = DeadLetters(producer, "sink")
    acked: list[bool] = []
    letters.send("blocks.dlq", InvalidInput(ErrorClass.CORRUPT_BLOCK, "bad"), b"x", None, lambda: acked.append(True),
                 source_topic="blocks", source_partition=0, source_offset=3)
    with pytest.raises(DeliveryFailed, match="Kafka refused a record for blocks.dlq"):
        producer.flush(10)
    assert not acked
    assert len(refused) == 1 and "blocks.dlq" in str(refused[0])


def _ready_event(request_id: str) -> HiddenStatesReady:
    return HiddenStatesReady(
        event_id=ready_event_id("ds", request_id), request_id=request_id, shard="shards/t-0-0.safetensors",
        tensors=TensorNames(hidden_states=f"{request_id}/hidden_states", token_ids=f"{request_id}/token_ids"),
        num_tokens=5, layer_ids=[1], dtype=DType.FLOAT32, hidden_size=8, model="tiny", checksum="crc32:00000001")


@pytest.mark.parametrize("transactional", [False, True], ids=["plain", "exactly-once"])
def test_ready_events_make_their_records_committable(kafka: KafkaSettings, transactional: bool) -> None:
    blocks, ready, group = _topic(kafka, 3), _topic(kafka, 0), f"g-{uuid.uuid4().hex[:8]}"
    member = GroupMember(kafka, group, blocks, "test_member", consumer_overrides={"session.timeout.ms": 6000},
                         commit_interval=3600)
    publisher = ReadyPublisher(kafka, RecordProducer.connect(kafka, "sink"), ready, member.marks, group if transactional else None)
    member.subscribe(commit=publisher.commit)
    publisher.bind(member.consumer)
    try:
        records = []
        deadline = time.monotonic() + 30
        while len(records) < 3 and time.monotonic() < deadline:
            records += member.poll(10, timeout=0.2)
        assert len(records) == 3

        def done() -> None:
            for offset in range(3):
                member.done((blocks, 0), offset)

        publisher.publish([_ready_event("r-1"), _ready_event("r-2")], done)
        # Exactly-once commits the offsets in the events' transaction; plain mode
        # leaves them to the member's next commit.
        assert _committed(kafka, group, blocks) == (3 if transactional else OFFSET_INVALID)
        member.commit()
        assert _committed(kafka, group, blocks) == 3
        events = [HiddenStatesReady.model_validate_json(r.value()) for r in drain(kafka, ready, expected=2)]
        assert sorted(e.request_id for e in events) == ["r-1", "r-2"]
    finally:
        member.close()


def test_liveness_fails_when_work_is_pending_without_progress(kafka: KafkaSettings) -> None:
    """Records on an assigned partition that the member never fetches (paused,
    as a member whose partitions came back paused was) make /healthz fail after
    ``stall_timeout``; fetching them makes it pass again."""
    topic = _topic(kafka, 5)
    member = GroupMember(kafka, f"g-{uuid.uuid4().hex[:8]}", topic, "test_member",
                         consumer_overrides={"session.timeout.ms": 6000}, stall_timeout=2)
    member.subscribe()
    try:
        member.pause(True)
        deadline = time.monotonic() + 30
        while not member.assignment and time.monotonic() < deadline:
            assert list(member.poll(10, timeout=0.2)) == []
        stalled_by = time.monotonic() + 30
        while member.stall.liveness()[0]:
            assert time.monotonic() < stalled_by, "never failed its liveness with 5 records pending"
            assert list(member.poll(10, timeout=0.2)) == []
            member.tick()
        live, reason = member.stall.liveness()
        assert not live and "stalled" in reason and "--stall-timeout 2" in reason

        member.pause(False)
        fetched = []
        while len(fetched) < 5 and time.monotonic() < stalled_by + 30:
            fetched += member.poll(10, timeout=0.2)
            member.tick()
        assert len(fetched) == 5 and member.stall.liveness() == (True, "ok")
    finally:
        member.close()
