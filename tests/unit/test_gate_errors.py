"""The gate's error paths that need no trainer: what it cannot read on the
served side is no fault of the checkpoint judged."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch

from hsx.dataset.draft_store import DraftStore
from hsx.schemas.drafts import PromotedDraft
from hsx.trainer.gate import Gate
from tests.unit.test_draft_checkpoint import write_draft


def _gate(drafts: Path, initial: Path) -> Gate:
    return Gate(str(drafts), initial, str(drafts / "no-dataset"), Path("verifier"), share=0.5, samples=4,
                margin=0.1, layers=[1, 2, 3], total_seq_len=64, dtype=torch.float32)


def test_a_served_draft_that_cannot_be_read_leaves_the_checkpoint_unjudged(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    drafts = tmp_path / "drafts"
    checkpoint = write_draft(tmp_path / "checkpoint")
    (drafts).mkdir()
    (drafts / "promoted.json").write_text(json.dumps(PromotedDraft(version=3, path="v3").model_dump()))
    with caplog.at_level(logging.ERROR, "hsx.trainer.draft"):
        assert _gate(drafts, write_draft(tmp_path / "initial")).judge(checkpoint) is None  # v3 was never uploaded
    assert DraftStore(drafts).decisions() == []  # not "refused": the next checkpoint is judged
    assert f"gate: {checkpoint} not judged" in caplog.text and "v3" in caplog.text


def test_a_checkpoint_that_does_not_fit_the_served_draft_is_refused_with_its_reason(tmp_path: Path) -> None:
    drafts = tmp_path / "drafts"
    checkpoint = write_draft(tmp_path / "checkpoint", vocab=999)
    decision = _gate(drafts, write_draft(tmp_path / "initial")).judge(checkpoint)
    assert decision is not None and decision.outcome == "refused" and decision.version == 0
    assert "vocab_size" in decision.reason and "999" in decision.reason
    assert [d["outcome"] for d in DraftStore(drafts).decisions()] == ["refused"]
