"""The gate between training and serving: each checkpoint ``hsx train-draft``
writes is judged against the draft the servers serve, on served samples kept
out of training (:mod:`hsx.trainer.holdout`), and promoted to the drafts store
the servers follow (``hsx serve --drafts``, a directory or ``s3://``:
:mod:`hsx.dataset.draft_store`) only when it is better by the operator's margin.

The score is teacher-forced acceptance, from the stored hidden states, with
speculators' own draft forward and its own accuracy: at draft position k
(1..K) the share of positions where the draft's first k proposals all equal the
verifier's next tokens, which is where greedy speculative decoding accepts k
tokens; the mean acceptance length it predicts is ``1 + sum``. A checkpoint
that is no drop-in for the served draft (:func:`hsx.runtime.draft_files.checked_tensors`:
it does not load, holds NaN or inf, another vocabulary, size or layer set) is
refused with the reason and never scored. A drafts store, served draft or
dataset that cannot be read is no fault of the checkpoint's: it goes unjudged
(logged, not recorded) and the next checkpoint is judged.

1. Read the held-out samples: the most recent ``samples`` of the dataset whose ids
   the holdout keeps (the dataset's index order; later shards are more recent).
2. Check the checkpoint against the served draft (refused: step 5).
3. Score the served draft and the checkpoint on the same samples.
4. Promote when the checkpoint's acceptance length is at least the served one's
   plus ``margin``: the checkpoint published (uploaded, to an object store) and
   the pointer replaced whole with the next version.
5. Record the decision (the store's ``decisions.jsonl``, one JSON object a line).
"""

from __future__ import annotations

import logging
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal, get_args

import torch

from hsx.dataset.draft_store import DraftStore, local_copy
from hsx.dataset.reader import open_dataset
from hsx.runtime.draft_files import DraftRefused, checked_tensors, read_config, tensor_shapes
from hsx.schemas.drafts import PromotedDraft
from hsx.trainer.dataset import HsxDataset
from hsx.trainer.holdout import held_out
from hsx.trainer.samples import TrainingSample
from hsx.trainer.stream_batches import SpeculatorsBatch, packed

log = logging.getLogger("hsx.trainer.draft")


@dataclass(frozen=True)
class Score:
    """Teacher-forced acceptance of one draft on the held-out samples."""

    per_position: list[float]
    positions: int
    """Token positions scored (the loss-masked ones)."""

    @property
    def acceptance_length(self) -> float:
        return 1 + sum(self.per_position)


Outcome = Literal["promoted", "kept", "refused"]
OUTCOMES: tuple[Outcome, ...] = get_args(Outcome)
"""What :meth:`Gate.judge` decides."""


@dataclass(frozen=True)
class Decision:
    checkpoint: str
    outcome: Outcome
    reason: str
    version: int | None = None
    """The version promoted, or the served one it was judged against."""
    candidate: Score | None = None
    served: Score | None = None


class Gate:
    """Judges checkpoints for the servers following ``drafts``."""

    def __init__(self, drafts: str, initial: Path, dataset: str, verifier: Path, *, share: float, samples: int,
                 margin: float, layers: list[int], total_seq_len: int, dtype: torch.dtype, ttt_steps: int = 3,
                 attn_impl: str = "sdpa") -> None:
        self.drafts, self.initial, self.dataset, self.verifier = DraftStore(drafts), initial, dataset, verifier
        self._downloads_dir = tempfile.TemporaryDirectory(prefix="hsx-gate-")  # removed at exit
        self._downloads = Path(self._downloads_dir.name)
        """The served draft, when the store is an object store."""
        self.share, self.samples, self.margin = share, samples, margin
        self.layers, self.total_seq_len, self.dtype = layers, total_seq_len, dtype
        self.ttt_steps, self.attn_impl = ttt_steps, attn_impl

    def served(self) -> PromotedDraft:
        """The draft the servers serve: the pointer's, else the one they started with (version 0)."""
        return self.drafts.promoted() or PromotedDraft(version=0, path=str(self.initial.resolve()))

    def judge(self, checkpoint: Path) -> Decision | None:
        """Steps 1-5 for ``checkpoint``; None when the drafts store, the served
        draft or the held-out samples could not be read or written (logged: no
        fault of the checkpoint's, which only its own reading errors refuse; the
        next checkpoint is judged)."""
        try:
            return self._judge(checkpoint)
        except (DraftRefused, OSError) as exc:  # the checkpoint's own are decisions: these are the served side's
            log.error("gate: %s not judged: %s (the next checkpoint will be)", checkpoint, exc)
            return None

    def _judge(self, checkpoint: Path) -> Decision:
        served = self.served()
        served_path = local_copy(served.path, self._downloads, only=True)
        config, shapes = read_config(served_path), tensor_shapes(served_path)
        try:
            checked_tensors(checkpoint, config, shapes)
        except (DraftRefused, OSError) as exc:
            return self._record(Decision(str(checkpoint), "refused", str(exc), served.version))
        held = self.held_out_samples()
        if not held:
            return self._record(Decision(str(checkpoint), "kept", "no held-out sample yet", served.version))
        candidate, current = self.score(checkpoint, held), self.score(served_path, held)
        better = candidate.acceptance_length - current.acceptance_length
        if better < self.margin:
            return self._record(Decision(str(checkpoint), "kept", f"acceptance length {candidate.acceptance_length:.3f} "
                                         f"vs {current.acceptance_length:.3f} served: {better:+.3f} < margin "
                                         f"{self.margin}", served.version, candidate, current))
        promoted = self.drafts.publish(PromotedDraft(
            version=served.version + 1, path=str(checkpoint.resolve()),
            reason=f"gate: {candidate.acceptance_length:.3f} vs {current.acceptance_length:.3f} on "
                   f"{candidate.positions} held-out positions"), checkpoint)
        return self._record(Decision(str(checkpoint), "promoted", promoted.reason or "", promoted.version, candidate,
                                     current))

    def held_out_samples(self) -> list[TrainingSample]:
        """Step 1."""
        ids = [rid for rid in reversed(open_dataset(self.dataset).request_ids()) if held_out(rid, self.share)]
        if not ids:
            return []
        dataset = HsxDataset(self.dataset, layers=self.layers)
        return [dataset[rid] for rid in ids[: self.samples]]

    @torch.no_grad()
    def score(self, draft: Path, samples: list[TrainingSample]) -> Score:
        """Step 3: speculators' forward and accuracy, teacher-forced, on ``samples``."""
        from speculators.models.eagle3 import Eagle3DraftModel
        from speculators.losses import resolve_loss_config

        config = Eagle3DraftModel.config_class.from_pretrained(draft)
        config.transformer_layer_config._attn_implementation = self.attn_impl  # noqa: SLF001 (as speculators' cli)
        model = Eagle3DraftModel.from_pretrained(draft, config=config, verifier=str(self.verifier))
        model = model.to(self.dtype).eval()  # a checkpoint may be saved in another dtype than the batches' 
        hidden = int(samples[0].hidden_states.shape[-1])
        collate = SpeculatorsBatch(self.total_seq_len, hidden, len(self.layers), self.dtype)
        correct = [0.0] * self.ttt_steps
        total = 0.0
        for group in packed(samples, self.total_seq_len):
            batch = {k: v for k, v in collate(group).items() if k != "positions"}
            _, _, metrics = model(**batch, ttt_steps=self.ttt_steps, ttt_step_loss_decay=1.0,
                                  loss_config=resolve_loss_config("kl_div", "eager"))
            for k in range(self.ttt_steps):
                correct[k] += float(metrics[f"full_acc_{k}_sum"])
            total += float(metrics["full_acc_0_total"])
        return Score([c / total if total else 0.0 for c in correct], int(total))

    def _record(self, decision: Decision) -> Decision:
        """Step 5."""
        line = {"time": time.time(), **asdict(decision)}
        for key in ("candidate", "served"):
            score = getattr(decision, key)
            if score is not None:
                line[key] = {**asdict(score), "acceptance_length": score.acceptance_length}
        self.drafts.record(line)
        log.info("gate: %s %s (%s)", decision.outcome, decision.checkpoint, decision.reason,
                 extra={"gate": decision.outcome})
        return decision


def decisions(drafts: str | Path) -> list[dict[str, Any]]:
    """The gate's decisions so far at the drafts store ``drafts``, in order."""
    return DraftStore(drafts).decisions()


def outcome_counts(judged: list[dict[str, Any]]) -> dict[str, int]:
    """How many of the decisions ``judged`` had each outcome."""
    return {outcome: sum(d["outcome"] == outcome for d in judged) for outcome in OUTCOMES}
