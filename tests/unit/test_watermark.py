"""Commit watermarks never move past an unfinished record."""

from __future__ import annotations

import random

from hsx.runtime.kafka.watermarks import Watermarks

TP = ("prompts", 0)


def test_position_is_lowest_pending_offset() -> None:
    marks = Watermarks()
    for offset in (10, 11, 12, 13):
        marks.track(TP, offset)
    assert marks.position(TP) == 10
    marks.done(TP, 12)
    marks.done(TP, 11)
    assert marks.position(TP) == 10  # 10 still running: nothing may be committed past it
    marks.done(TP, 10)
    assert marks.position(TP) == 13
    marks.done(TP, 13)
    assert marks.position(TP) == 14
    assert marks.in_flight() == 0


def test_to_commit_reports_only_moved_positions() -> None:
    marks = Watermarks()
    other = ("prompts", 1)
    marks.track(TP, 0)
    marks.track(other, 5)
    marks.done(TP, 0)
    assert marks.to_commit() == {TP: 1, other: 5}
    marks.committed({TP: 1, other: 5})
    assert marks.to_commit() == {}
    marks.done(other, 5)
    assert marks.to_commit() == {other: 6}


def test_revoked_partition_is_forgotten_and_late_completions_ignored() -> None:
    marks = Watermarks()
    marks.track(TP, 3)
    marks.forget(TP)
    marks.done(TP, 3)
    assert marks.position(TP) is None and marks.to_commit() == {}


def test_random_completion_order_matches_a_reference() -> None:
    rng = random.Random(1)
    marks = Watermarks()
    offsets = list(range(100, 400))
    for offset in offsets:
        marks.track(TP, offset)
    finished: set[int] = set()
    for offset in rng.sample(offsets, len(offsets)):
        marks.done(TP, offset)
        finished.add(offset)
        expected = next((o for o in offsets if o not in finished), offsets[-1] + 1)
        assert marks.position(TP) == expected
