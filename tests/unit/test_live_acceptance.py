"""``hsx serve --draft``'s live acceptance per draft version and its rollback
rule: a newly served draft worse than the one before by more than the noise is
rolled back (the earlier draft promoted again, as a new version); one within the
noise, or better, stays."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from hsx.dataset.draft_store import DraftStore
from hsx.schemas.drafts import PromotedDraft
from hsx.schemas.reports import DraftSwapReport, SpeculationReport
from hsx.serving.acceptance import LiveAcceptance, regressed
from hsx.serving.rollbacks import Rollbacks


def _serve(live: LiveAcceptance, version: int, rate: float, requests: int, seed: int) -> None:
    """``requests`` of 20 verify steps each, every draft token accepted at ``rate``
    (so K = 3 positions accept with rate, rate², rate³)."""
    rng = random.Random(seed)
    for _ in range(requests):
        accepted = [0, 0, 0]
        for _ in range(20):
            for k in range(3):
                if rng.random() >= rate:
                    break
                accepted[k] += 1
        live.add(SpeculationReport(draft_version=version, verify_steps=20, accepted_per_position=accepted))


def test_a_window_is_the_latest_requests_weighted_by_their_steps() -> None:
    live = LiveAcceptance(window=2)
    live.add(SpeculationReport(draft_version=0, verify_steps=10, accepted_per_position=[5, 0, 0]))
    assert live.window(0) is None  # not full yet
    live.add(SpeculationReport(draft_version=0, verify_steps=30, accepted_per_position=[30, 15, 0]))
    window = live.window(0)
    assert window is not None and window.acceptance_length == pytest.approx(1 + 50 / 40)
    live.add(SpeculationReport(draft_version=0, verify_steps=0, accepted_per_position=[0, 0, 0]))  # nothing drafted
    assert live.window(0) == window
    assert live.totals() == {0: (2, pytest.approx(1 + 50 / 40))}


@pytest.mark.parametrize(("before", "after", "rolled_back"), [(0.6, 0.3, True), (0.6, 0.59, False),
                                                               (0.3, 0.6, False)])
def test_a_worse_draft_is_rolled_back_once_and_only_beyond_the_noise(tmp_path: Path, before: float, after: float,
                                                                     rolled_back: bool) -> None:
    live = LiveAcceptance(window=64)
    _serve(live, 0, before, 64, seed=1)
    DraftStore(tmp_path).publish(PromotedDraft(version=1, path="/drafts/new"))
    swaps = [DraftSwapReport(version=1, path="/drafts/new", outcome="swapped")]
    rollbacks = Rollbacks(DraftStore(tmp_path), "/drafts/first")
    rollbacks.check(swaps, live)  # the new draft has no full window yet
    assert rollbacks.count == 0
    _serve(live, 1, after, 64, seed=2)
    rollbacks.check(swaps, live)
    rollbacks.check(swaps, live)  # judged once
    assert rollbacks.count == int(rolled_back)
    pointer = DraftStore(tmp_path).promoted()
    assert pointer is not None
    if rolled_back:
        assert (pointer.version, pointer.path) == (2, "/drafts/first") and "rollback of 1" in (pointer.reason or "")
    else:
        assert pointer.version == 1


def _worse(tmp_path: Path) -> tuple[list[DraftSwapReport], LiveAcceptance]:
    """Version 1 promoted and served, at half the acceptance rate of version 0."""
    live = LiveAcceptance(window=64)
    _serve(live, 0, 0.6, 64, seed=1)
    _serve(live, 1, 0.3, 64, seed=2)
    DraftStore(tmp_path).publish(PromotedDraft(version=1, path="/drafts/new"))
    return [DraftSwapReport(version=1, path="/drafts/new", outcome="swapped")], live


def test_a_server_beside_another_leaves_a_rollback_already_published(tmp_path: Path) -> None:
    """Two servers follow one store: the first to judge version 1 worse rolls it
    back; the second finds the pointer moved on and publishes nothing."""
    swaps, live = _worse(tmp_path)
    first, second = Rollbacks(DraftStore(tmp_path), "/drafts/first"), Rollbacks(DraftStore(tmp_path), "/drafts/first")
    first.check(swaps, live)
    second.check(swaps, live)
    assert (first.count, second.count) == (1, 0)
    pointer = DraftStore(tmp_path).promoted()
    assert pointer is not None and (pointer.version, pointer.path) == (2, "/drafts/first")


def test_a_store_that_does_not_answer_is_asked_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    swaps, live = _worse(tmp_path)
    store = DraftStore(tmp_path)
    rollbacks = Rollbacks(store, "/drafts/first")
    with monkeypatch.context() as patched:
        patched.setattr(store, "promoted", lambda: (_ for _ in ()).throw(OSError("connection refused")))
        rollbacks.check(swaps, live)  # logged, not raised: the serving loop goes on
    assert rollbacks.count == 0
    rollbacks.check(swaps, live)
    assert rollbacks.count == 1 and DraftStore(tmp_path).promoted().version == 2  # type: ignore[union-attr]


def test_regressed_needs_the_drop_to_exceed_twice_the_combined_error() -> None:
    live = LiveAcceptance(window=64)
    _serve(live, 0, 0.5, 64, seed=3)
    _serve(live, 1, 0.5, 64, seed=4)
    same = live.window(0), live.window(1)
    assert same[0] is not None and same[1] is not None and not regressed(*same)
