"""The lost path, taken deterministically: the broker is frozen (SIGSTOP) for
longer than the session timeout, so librdkafka gives the partitions up as
*lost*; when the broker returns, the member rejoins and must fetch again
whatever its pause state was when the partitions went. First the group member
alone, then both services with work in every stage while ``hsx produce``
publishes more prompts (a broker outage: everyone carries on by themselves).

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
from confluent_kafka import Message

from hsx import models
from hsx.local.broker import EmbeddedBroker
from hsx.local.commands import extract_command, produce_command, sink_command
from hsx.local.spawn import HsxService
from hsx.local.topics import fresh_topics
from hsx.runtime.kafka import RecordProducer, ensure_topics
from hsx.runtime.kafka.member import GroupMember
from hsx.runtime.settings import KafkaSettings, TopicSettings
from tests.reliability.harness import (
    as_records, check_exactly_once, index_counts, publish, record_figures, text_prompts, wait_until,
)
from tests.unit.test_assembler import records

pytestmark = pytest.mark.integration

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
OUTAGE_S = 30.0
"""Past the 6 s session timeout of the services' dev commands (both lose their
partitions) and half of the one-shot commands' 60 s wait for the cluster."""
RECOVERY_BOUND_S = 180.0
"""Every prompt stored within this of the broker's return: rejoining takes seconds
and the run's remaining work about half a minute on 2 cores; a stalled service
would use it all."""


@pytest.mark.engine
def test_services_resume_after_losing_their_partitions_with_work_in_every_stage(tmp_path: Path) -> None:
    """At the moment the broker goes: the extractor holds ``max_inflight`` prompts
    (waiting for Kafka's acks), the sink an open shard and an incomplete sample
    (blocks without their manifest), and its shard closes during the outage, so
    ready events are pending when the partitions are lost. Meanwhile ``hsx
    produce`` publishes more prompts: it, too, rides the outage out."""
    model = models.prepare(names=["smollm2-135m-instruct"])["smollm2-135m-instruct"]
    before, during = text_prompts(60, "lost"), text_prompts(30, "during")
    with EmbeddedBroker() as broker:
        kafka = KafkaSettings(bootstrap=broker.bootstrap)
        topics = fresh_topics(kafka)
        publish(kafka, topics.prompts, as_records(before))
        publish(kafka, topics.blocks, records("partial-0")[0][:-1])  # its manifest never comes
        late = tmp_path / "late.jsonl"
        late.write_bytes(b"".join(orjson.dumps(p) + b"\n" for p in during))
        output = tmp_path / "dataset"
        extractor = HsxService("extractor", extract_command(
            kafka.bootstrap, topics, model, "--max-model-len", "512", "--max-inflight", str(MAX_INFLIGHT),
            group="x-lost"), tmp_path)
        sink = HsxService("sink", sink_command(
            kafka.bootstrap, topics, output, "--max-shard-samples", "1000", "--max-shard-age", "4", group="s-lost"),
            tmp_path)
        with extractor, sink:
            # Early in the run (the extractor's count, not the dataset's, whose shards
            # close only every few seconds), with max_inflight prompts running and as
            # many fetched and waiting: a full backlog, so its partitions are paused.
            # Frozen, Kafka acknowledges none of the running prompts' records, and the
            # extractor holds max_inflight of them, all waiting for acks.
            wait_until(lambda: extractor.counter("hsx_extractor_prompts_total") >= 5
                       and extractor.metric("hsx_extractor_prompts_waiting") == MAX_INFLIGHT, 300,
                       "the run to be under way with a full backlog")
            os.kill(broker.pid, signal.SIGSTOP)
            stopped = time.monotonic()
            try:
                wait_until(lambda: extractor.metric("hsx_extractor_prompts_in_flight") == MAX_INFLIGHT, 60,
                           "max_inflight prompts in flight while the broker is away")
                assert sink.metric("hsx_sink_buffered_bytes") > 0, "the sink holds nothing"
                producer = HsxService("produce", produce_command(kafka.bootstrap, topics, late), tmp_path,
                                      health=False).start()
                ready_during = []
                while time.monotonic() - stopped < OUTAGE_S:
                    ready_during.append(extractor.ready())
                    time.sleep(2)
            finally:
                os.kill(broker.pid, signal.SIGCONT)
            returned = time.monotonic()
            assert producer.wait(300) == 0, producer.log_tail()
            wait_until(lambda: len(index_counts(output)) >= len(before) + len(during), RECOVERY_BOUND_S,
                       f"every prompt within {RECOVERY_BOUND_S:.0f}s of the broker's return")
            recovered = time.monotonic() - returned
            for service in (extractor, sink):
                assert "lost [" in service.log_tail(200_000), f"{service.name} never lost its partitions"
                assert service.exited() is None and service.incarnations == 1, service.log_tail()
                assert service.ready(), f"{service.name} not ready after recovering"
                assert service.stop() == 0, service.log_tail()
        check_exactly_once(kafka, topics, output, {str(p["request_id"]) for p in before + during})
    record_figures("lost_assignment", {
        "prompts": len(before) + len(during), "published_during_outage": len(during),
        "outage_s": round(returned - stopped, 1), "max_inflight": MAX_INFLIGHT,
        "all_done_s_after_return": round(recovered, 1),
        "extractor_ready_probes_during_outage": f"{sum(ready_during)}/{len(ready_during)} ready"})
