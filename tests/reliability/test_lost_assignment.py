"""The lost path of the consumer-group member, taken deterministically: the
broker is frozen (SIGSTOP) for longer than the session timeout, so librdkafka
gives the partitions up as *lost*; when the broker returns, the member rejoins
and must fetch again whatever its pause state was when the partitions went.

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

import pytest

from runtime.broker import EmbeddedBroker
from runtime.kafka import RecordProducer, ensure_topics
from runtime.kafka.member import GroupMember
from runtime.settings import KafkaSettings, TopicSettings

pytestmark = pytest.mark.integration

SESSION_TIMEOUT_MS = 6000
RESUME_BOUND_S = 30.0
"""After the broker returns: rejoin (a few seconds) and fetch the new records."""


def _wait(condition, member: GroupMember, timeout: float, what: str) -> list:  # type: ignore[no-untyped-def]
    fetched = []
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
