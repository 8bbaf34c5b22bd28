"""The extractor's backlog: FIFO order, partitions dropped on revoke, and the
pause rule with its hysteresis (full → pause; paused → resume at half)."""

from __future__ import annotations

import pytest
from confluent_kafka import Message

from hsx.extractor.backlog import Backlog


def _records(partition: int, offsets: range) -> list[Message]:
    return [Message(topic="prompts", partition=partition, offset=o) for o in offsets]


def test_records_come_out_oldest_first() -> None:
    backlog = Backlog(4)
    backlog.add(_records(0, range(3)))
    assert backlog.room == 1
    assert [backlog.take().offset() for _ in range(3)] == [0, 1, 2]
    assert backlog.take() is None and len(backlog) == 0


def test_revoked_partitions_are_dropped_and_the_rest_keeps_its_order() -> None:
    backlog = Backlog(8)
    backlog.add(_records(0, range(2)) + _records(1, range(10, 13)) + _records(0, range(2, 4)))
    backlog.drop([("prompts", 0), ("other", 1)])
    assert [(r.partition(), r.offset()) for r in (backlog.take() for _ in range(len(backlog)))] == [
        (1, 10), (1, 11), (1, 12)]


@pytest.mark.parametrize("capacity", [1, 2, 5, 64])
def test_pauses_when_full_and_resumes_at_half(capacity: int) -> None:
    backlog, paused, changes = Backlog(capacity), False, []
    for fill in [*range(capacity + 1), *range(capacity, -1, -1)]:
        while len(backlog) < fill:
            backlog.add(_records(0, range(1)))
        while len(backlog) > fill:
            backlog.take()
        if backlog.should_pause(paused) != paused:
            paused = not paused
            changes.append((fill, paused))
    assert changes == [(capacity, True), (capacity // 2, False)]


def test_a_backlog_holds_at_least_one_prompt() -> None:
    with pytest.raises(ValueError, match="at least one prompt"):
        Backlog(0)
