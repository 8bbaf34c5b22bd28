"""The lost path, taken deterministically: the broker is frozen (SIGSTOP) for
longer than the session timeout, so librdkafka gives the partitions up as
*lost*; when the broker returns, the member rejoins and must fetch again
whatever its pause state was when the partitions went. First the group member
alone, then both services with work in every stage while ``hsx produce``
publishes more prompts (a broker outage: everyone carries on by themselves), a
state the test sets up itself (the engine frozen first, then the broker) rather
than waits to see.

The cause of an extractor that stalled after a broker outage: librdkafka keeps a
partition's application pause flag across a loss and re-assignment, so a member
that was paused when it lost its partitions, and unpaused while it held none,
got them back still paused and never fetched again.
"""

from __future__ import annotations

import os
import signal
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import orjson
import pytest
from confluent_kafka import Consumer, KafkaError, Message, TopicPartition

from hsx import models
from hsx.local.broker import EmbeddedBroker
from hsx.local.commands import extract_command, produce_command, sink_command
from hsx.local.scrape import get
from hsx.local.spawn import HsxService, cpu_engine_env
from hsx.local.topics import fresh_topics
from hsx.runtime.kafka import RecordProducer, ensure_topics
from hsx.runtime.kafka.member import GroupMember
from hsx.runtime.settings import KafkaSettings, TopicSettings
from tests.reliability.harness import (
    as_records, check_exactly_once, index_counts, publish, record_figures, text_prompts,
)
from tests.unit.test_assembler import records

pytestmark = [pytest.mark.integration, pytest.mark.faults]

SESSION_TIMEOUT_MS = 6000
RESUME_BOUND_S = 30.0
"""After the broker returns: rejoin (a few seconds) and fetch the new records."""


def _wait(condition: Callable[[], bool], member: GroupMember, timeout: float, what: str) -> list[Message]:
    """Poll ``member`` until ``condition`` holds; returns what it fetched meanwhile."""
    fetched: list[Message] = []
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out after {timeout:.0f}s waiting for {what}"
        fetched += member.poll(100, timeout=0.2)
    return fetched


@pytest.mark.parametrize("unpause", ["while_unassigned", "after_reassignment", "never_paused"])
def test_a_member_fetches_again_after_losing_its_partitions(unpause: str) -> None:
    with EmbeddedBroker() as broker:  # its own broker: it is frozen
        kafka = KafkaSettings(bootstrap=broker.bootstrap)
        topic = f"lost-{uuid.uuid4().hex[:8]}"
        ensure_topics(kafka, TopicSettings(partitions=2), [topic])
        member = GroupMember(kafka, f"g-{uuid.uuid4().hex[:8]}", topic, "test_lost",
                             consumer_overrides={"session.timeout.ms": SESSION_TIMEOUT_MS})
        member.subscribe()
        try:
            _wait(lambda: len(member.assignment) == 2, member, 30, "the assignment")
            member.pause(unpause != "never_paused")  # e.g. the extractor at max_inflight

            os.kill(broker.pid, signal.SIGSTOP)
            try:
                _wait(lambda: not member.assignment, member, 30, "the partitions to be lost")
                if unpause == "while_unassigned":  # the in-flight work finished meanwhile
                    member.pause(False)
            finally:
                os.kill(broker.pid, signal.SIGCONT)
            returned = time.monotonic()

            producer = RecordProducer.connect(kafka, "test")
            for i in range(20):
                producer.produce(topic, str(i).encode(), key=str(i).encode())
            producer.flush(30)
            fetched = _wait(lambda: len(member.assignment) == 2, member, RESUME_BOUND_S, "the re-assignment")
            if unpause == "after_reassignment":
                member.pause(False)
            deadline = returned + RESUME_BOUND_S
            while len(fetched) < 20 and time.monotonic() < deadline:
                fetched += member.poll(100, timeout=0.2)
            assert sorted(int(m.value()) for m in fetched) == list(range(20)), (
                f"{len(fetched)} of 20 records fetched within {RESUME_BOUND_S:.0f}s of the broker's return")
        finally:
            member.close()


MAX_INFLIGHT = 4
EARLY = 5
"""Prompts extracted and stored before the fault is set up: the run is under way."""
OUTAGE_S = 30.0
"""Past the 6 s session timeout of the services' dev commands (both lose their
partitions) and half of the one-shot commands' 60 s wait for the cluster."""
SHARD_AGE_S = 2
"""The sink's ``--max-shard-age``: the shard it holds when the broker stops
closes within this, during the outage."""
SINK_HEARTBEAT = {"HSX_KAFKA_CLIENT_PROPERTIES": orjson.dumps({"heartbeat.interval.ms": "1000"}).decode()}
"""The sink's heartbeat every second (librdkafka's default: 3 s), so that it loses
its partitions 5 to 6 s into the outage (its session, from its last answered
heartbeat), at least 3 s after the shard it held closed: that shard is written
during the outage and its ready events wait for Kafka when the partitions go. (At
3 s the loss could come 3 s in, about when the shard closes.)"""
PROGRESS_BOUND_S = 90.0
"""After the broker's return the dataset grows at least this often until every
prompt is stored: rejoining takes seconds (about 25 s on a busy 2-core machine
before the first new sample), a prompt much less; a stalled service adds
nothing more. A bound on the whole recovery would instead measure the machine:
the remaining 85 prompts took from 30 s to over 3 minutes on 2 cores, with
other work running."""


def _offsets(kafka: KafkaSettings, topic: str, group: str, partitions: int) -> dict[int, tuple[int, int]]:
    """Per partition of ``topic``: ``group``'s committed offset (0 before its first
    commit) and the end of the partition, as a fetch there reports it (tansu 0.6
    answers a ListOffsets for the latest offset with its last batch's base offset
    + 1, short of the end when that batch holds more than one record)."""
    consumer = Consumer({"bootstrap.servers": kafka.bootstrap, "group.id": group, "enable.auto.commit": False,
                         "enable.partition.eof": True, "fetch.wait.max.ms": 10})
    try:
        tps = consumer.committed([TopicPartition(topic, p) for p in range(partitions)], timeout=10)
        committed = {tp.partition: max(tp.offset, 0) for tp in tps}
        consumer.assign([TopicPartition(topic, p, offset) for p, offset in committed.items()])
        ends: dict[int, int] = {}
        deadline = time.monotonic() + 30
        while len(ends) < partitions:
            assert time.monotonic() < deadline, f"no end of {topic} reached: {ends}"
            for message in consumer.consume(1000, timeout=0.1):
                error = message.error()
                if error is not None and error.code() == KafkaError._PARTITION_EOF:
                    ends[message.partition()] = message.offset()
        return {p: (committed[p], ends[p]) for p in committed}
    finally:
        consumer.close()


def _acked(service: HsxService, topic: str) -> float:
    """Records ``service`` produced to ``topic`` that Kafka acknowledged (NaN
    when its endpoint does not answer)."""
    try:
        lines = get(service.port, "/metrics")[1].splitlines()
    except OSError:
        return float("nan")
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith("hsx_produced_records_total{")
               and f'topic="{topic}"' in line and 'outcome="acked"' in line)


def _until(condition: Callable[[], bool], timeout: float, what: str) -> None:
    """Like ``wait_until``, looking ten times a second: the setup's steps follow
    one another."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out after {timeout:.0f}s waiting for {what}"
        time.sleep(0.1)


def _gauge(service: HsxService, name: str) -> float:
    """An unlabelled gauge, waiting for the endpoint to answer."""
    value = float("nan")

    def answered() -> bool:
        nonlocal value
        value = service.metric(name)
        return value == value

    _until(answered, 30, f"{service.name}'s {name}")
    return value


def _stop_broker_while_the_sink_holds_a_sample(
    broker: EmbeddedBroker, kafka: KafkaSettings, topics: TopicSettings, sink: HsxService, output: Path,
    stored: set[str], incomplete_on: set[int],
) -> str:
    """SIGSTOP the broker while the sink holds a sample in an open shard and
    nothing else: every sample it was sent (``stored``) written and announced,
    and every offset it finished committed, so no commit waits for the frozen
    broker (a synchronous commit would hold its loop, and the shard, for the
    whole outage). The sample is one any connector could send; returns its
    request id (added to ``stored``). Its shard closes within
    :data:`SHARD_AGE_S`: when that happened before the broker stopped (a stall
    of the test), the broker goes on and another sample is sent."""
    for attempt in range(10):
        seen: list[object] = []

        def idle() -> bool:
            acked = _acked(sink, topics.ready)
            offsets = _offsets(kafka, topics.blocks, "s-lost", topics.partitions)
            seen[:] = [acked, offsets]
            # Each stored sample's event acknowledged (its shard finished), each
            # offset committed but the incomplete sample's and those behind it.
            return acked >= len(stored) and all(done == end for p, (done, end) in offsets.items()
                                                 if p not in incomplete_on)

        deadline = time.monotonic() + 120
        while True:
            assert time.monotonic() < deadline, (
                f"the sink did not store, announce and commit the {len(stored)} samples it was sent: "
                f"{seen[0]} events acknowledged, (committed, end) offsets {seen[1]}")
            if idle():
                held = _gauge(sink, "hsx_sink_buffered_bytes")  # the incomplete sample's blocks; the
                time.sleep(0.3)  # gauge is set once per loop (0.2 s at most), after the events' acks
                if _gauge(sink, "hsx_sink_buffered_bytes") == held:
                    break
            time.sleep(0.1)
        request_id = f"held-{attempt}"
        publish(kafka, topics.blocks, records(request_id)[0])
        stored.add(request_id)
        deadline = time.monotonic() + 60
        while not sink.metric("hsx_sink_buffered_bytes") > held:
            assert time.monotonic() < deadline, "the sink never took the sample"
            time.sleep(0.05)
        os.kill(broker.pid, signal.SIGSTOP)
        if request_id not in index_counts(output):
            return request_id
        os.kill(broker.pid, signal.SIGCONT)
    raise AssertionError(f"the sink wrote each of {attempt + 1} samples before the broker could be stopped")


def _wait_for_the_dataset(output: Path, samples: int) -> None:
    """Until ``output`` holds ``samples`` samples; fails once it went
    :data:`PROGRESS_BOUND_S` without a new one."""
    stored, grew = -1, time.monotonic()
    while (count := len(index_counts(output))) < samples:
        if count > stored:
            stored, grew = count, time.monotonic()
        assert time.monotonic() - grew < PROGRESS_BOUND_S, (
            f"no sample stored for {PROGRESS_BOUND_S:.0f}s, {count} of {samples} stored: a service stalled")
        time.sleep(0.2)


@pytest.mark.engine
def test_services_resume_after_losing_their_partitions_with_work_in_every_stage(tmp_path: Path) -> None:
    """When the broker goes, the extractor holds ``max_inflight`` prompts
    (waiting for Kafka's acks) and a full backlog (its partitions paused), the
    sink an open shard and an incomplete sample (blocks without their manifest);
    the shard closes during the outage, so ready events are pending when the
    partitions are lost. Meanwhile ``hsx produce`` publishes more prompts: it,
    too, rides the outage out.

    The test makes that moment rather than waiting for it (a fast run passes
    through any moment between two polls): the engine is frozen (SIGSTOP), so
    prompts it starts cannot finish, and the backlog stays full; the sink is
    sent a sample once it holds nothing else, and the broker is frozen while its
    shard is open; then the engine goes on, and the prompts it finishes wait for
    the broker's acks."""
    model = models.prepare(names=["smollm2-135m-instruct"])["smollm2-135m-instruct"]
    before, during = text_prompts(60, "lost"), text_prompts(30, "during")
    early = before[:EARLY]
    with EmbeddedBroker() as broker:
        kafka = KafkaSettings(bootstrap=broker.bootstrap)
        topics = fresh_topics(kafka)
        publish(kafka, topics.blocks, records("partial-0")[0][:-1])  # its manifest never comes
        incomplete_on = {p for p, (_, end) in _offsets(kafka, topics.blocks, "s-lost", topics.partitions).items()
                         if end}  # the partition its blocks are on: its offsets are never committed
        publish(kafka, topics.prompts, as_records(early))
        late = tmp_path / "late.jsonl"
        late.write_bytes(b"".join(orjson.dumps(p) + b"\n" for p in during))
        output = tmp_path / "dataset"
        extractor = HsxService("extractor", extract_command(
            kafka.bootstrap, topics, model, "--max-model-len", "512", "--max-inflight", str(MAX_INFLIGHT),
            group="x-lost"), tmp_path)
        sink = HsxService("sink", sink_command(
            kafka.bootstrap, topics, output, "--max-shard-samples", "1000", "--max-shard-age", str(SHARD_AGE_S),
            group="s-lost"), tmp_path, env=cpu_engine_env(**SINK_HEARTBEAT))
        with extractor, sink:
            _until(lambda: extractor.counter("hsx_extractor_prompts_total") >= EARLY, 300, "the first prompts")
            engine = extractor.child("VLLM::EngineCore")
            os.kill(engine, signal.SIGSTOP)
            try:
                publish(kafka, topics.prompts, as_records(before[EARLY:]))
                _until(lambda: extractor.metric("hsx_extractor_prompts_in_flight") == MAX_INFLIGHT
                       and extractor.metric("hsx_extractor_prompts_waiting") >= MAX_INFLIGHT, 60,
                       "max_inflight prompts in flight and a full backlog")
                # The early prompts' offsets committed: nothing left that a commit
                # would wait for the broker with (nothing more finishes before it goes).
                _until(lambda: sum(done for done, _ in _offsets(
                    kafka, topics.prompts, "x-lost", topics.partitions).values()) == EARLY, 60,
                       "the extractor to commit the first prompts")
                stored = {str(p["request_id"]) for p in early}
                held = _stop_broker_while_the_sink_holds_a_sample(
                    broker, kafka, topics, sink, output, stored, incomplete_on)
                stopped = time.monotonic()
                extractor_log_at_stop = len(extractor.logs())  # a loss takes seconds yet
            finally:
                os.kill(engine, signal.SIGCONT)  # its prompts finish; Kafka acknowledges none of their records
            try:
                producer = HsxService("produce", produce_command(kafka.bootstrap, topics, late), tmp_path,
                                      health=False).start()
                ready_during: list[bool] = []
                before_loss: list[tuple[float, float]] = []  # the extractor's (in flight, waiting)
                while time.monotonic() - stopped < OUTAGE_S:
                    ready_during.append(extractor.ready())
                    state = (extractor.metric("hsx_extractor_prompts_in_flight"),
                             extractor.metric("hsx_extractor_prompts_waiting"))
                    if "lost [" not in extractor.logs()[extractor_log_at_stop:]:  # read after the state: not lost then
                        before_loss.append(state)
                    time.sleep(1)
                held_stored_during = held in index_counts(output)
            finally:
                os.kill(broker.pid, signal.SIGCONT)
            returned = time.monotonic()
            # Until it lost its partitions, the extractor held max_inflight prompts and a full backlog.
            answered = [s for s in before_loss if s[0] == s[0] and s[1] == s[1]]
            assert answered and all(f == MAX_INFLIGHT and w >= MAX_INFLIGHT for f, w in answered), before_loss
            # The sink wrote the held sample's shard during the outage: it closed
            # before the partitions went (a loss finishes a write under way).
            assert held_stored_during, f"the sink did not write {held} during the outage"
            assert producer.wait(300) == 0, producer.log_tail()
            ids = {str(p["request_id"]) for p in before + during} | stored
            _wait_for_the_dataset(output, len(ids))
            recovered = time.monotonic() - returned
            # Its ready event was waiting for Kafka when the partitions went: their
            # next owner replayed the uncommitted sample and found it stored.
            assert f"duplicate of {held} dropped" in sink.logs(), sink.log_tail()
            for service in (extractor, sink):
                assert "lost [" in service.logs(), f"{service.name} never lost its partitions"
                assert service.exited() is None and service.incarnations == 1, service.log_tail()
                assert service.ready(), f"{service.name} not ready after recovering"
                assert service.stop() == 0, service.log_tail()
        check_exactly_once(kafka, topics, output, ids)
    record_figures("lost_assignment", {
        "prompts": len(before) + len(during), "published_during_outage": len(during),
        "outage_s": round(returned - stopped, 1), "max_inflight": MAX_INFLIGHT,
        "all_done_s_after_return": round(recovered, 1),
        "extractor_ready_probes_during_outage": f"{sum(ready_during)}/{len(ready_during)} ready"})
