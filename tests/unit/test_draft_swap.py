"""The scheduler side of a draft swap (``SwapPlan``): what every rank is told
each step, from the drafts directory's pointer and the ranks' word; and how
the ranks' words combine. The engine side is ``tests/integration/test_serve_draft.py``."""

from __future__ import annotations

from pathlib import Path

import pytest

from hsx.extractor.connector import draft_swap
from hsx.extractor.connector.draft_swap import DraftWorkerMeta, SwapPlan
from hsx.schemas.drafts import PROMOTED_FILE, PromotedDraft
from hsx.schemas.reports import DraftSwapReport


@pytest.fixture(autouse=True)
def no_poll_wait(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(draft_swap, "POLL_SECONDS", 0.0)


def _promote(drafts: Path, version: int, path: str) -> None:
    (drafts / PROMOTED_FILE).write_text(PromotedDraft(version=version, path=path).model_dump_json())


def test_a_promoted_draft_is_prepared_then_swapped_once_every_rank_has_it(tmp_path: Path) -> None:
    reports: list[DraftSwapReport] = []
    plan = SwapPlan(str(tmp_path), reports.append)
    assert plan.step() == (None, None)  # no pointer yet
    _promote(tmp_path, 1, "one")
    prepare, swap = plan.step()
    assert prepare is not None and prepare.version == 1 and prepare.path == str(tmp_path / "one") and swap is None
    assert plan.step() == (None, None)  # told once
    plan.worker_said(DraftWorkerMeta(serving=0, prepared=None))  # a rank still loading
    assert plan.step() == (None, None)
    plan.worker_said(DraftWorkerMeta(serving=0, prepared=1))
    assert plan.step() == (None, 1)
    assert plan.serving == 0  # until the ranks say they serve it
    plan.worker_said(DraftWorkerMeta(serving=1))
    assert plan.serving == 1 and [(r.version, r.outcome) for r in reports] == [(1, "swapped")]
    assert plan.step() == (None, None)


def test_a_refused_draft_is_reported_and_never_asked_for_again(tmp_path: Path) -> None:
    reports: list[DraftSwapReport] = []
    plan = SwapPlan(str(tmp_path), reports.append)
    _promote(tmp_path, 2, str(tmp_path / "bad"))
    assert plan.step()[0] is not None
    plan.worker_said(DraftWorkerMeta(serving=0, refused={2: "fc.weight holds NaN or inf"}))
    assert plan.serving == 0
    assert [(r.version, r.outcome, r.reason) for r in reports] == [(2, "refused", "fc.weight holds NaN or inf")]
    (tmp_path / PROMOTED_FILE).write_text(PromotedDraft(version=2, path="bad", reason="again").model_dump_json())
    assert plan.step() == (None, None)  # the same version, rewritten: still refused


def test_a_newer_promotion_replaces_one_in_preparation(tmp_path: Path) -> None:
    plan = SwapPlan(str(tmp_path), lambda _: None)
    _promote(tmp_path, 1, "one")
    assert plan.step()[0].version == 1  # type: ignore[union-attr]
    _promote(tmp_path, 2, "two-longer-name")  # another size: seen as changed whatever the clock's resolution
    prepare, _ = plan.step()
    assert prepare is not None and prepare.version == 2
    plan.worker_said(DraftWorkerMeta(serving=0, prepared=1))  # the old order's result: not swapped
    assert plan.step() == (None, None)


def test_an_unreadable_pointer_changes_nothing(tmp_path: Path) -> None:
    plan = SwapPlan(str(tmp_path), lambda _: None)
    (tmp_path / PROMOTED_FILE).write_text("{not json")
    assert plan.step() == (None, None) and plan.serving == 0


def test_ranks_agree_only_on_what_each_says() -> None:
    a = DraftWorkerMeta(serving=1, prepared=2, refused={})
    b = DraftWorkerMeta(serving=1, prepared=None, refused={3: "why"})
    combined = a.aggregate(b)
    assert combined == DraftWorkerMeta(serving=1, prepared=None, refused={3: "why"})
    assert a.aggregate(DraftWorkerMeta(serving=2, prepared=2)) == DraftWorkerMeta(serving=1, prepared=2)
