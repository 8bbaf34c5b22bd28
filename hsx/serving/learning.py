"""``hsx serve --draft D --learn --save-path DIR``: the learning loop on one
machine, beside the server. The server captures its traffic into the dataset
(``--output``) while it speculates; ``hsx train-draft`` trains on the ready
events from the draft the server serves (``--init-from``), judges each
checkpoint on held-out served samples and promotes the better ones to
``DIR/drafts``; the server swaps each promoted draft in between two steps
(``--drafts DIR/drafts``).

1. ``DIR/drafts`` is the drafts directory the server follows; a draft promoted
   there by an earlier run is where training resumes from (and the server takes
   it up with its first traffic).
2. The trainer starts once the server answers, as a child process of its own in
   the environment that has speculators (``--trainer-python``), its checkpoints
   in ``DIR/trainer/<ready topic>``.
3. While serving, a trainer that died is started again (it resumes from its
   last checkpoint and offsets; the server serves on with its draft meanwhile).
   A promoted draft that serves worse than the one before is rolled back by the
   server itself, as every server following a drafts store does
   (:mod:`hsx.serving.rollbacks`).
4. On SIGTERM the trainer is stopped first (it checkpoints, commits and judges
   what it trained), then the server drains.
"""

from __future__ import annotations

import logging
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from prometheus_client import Gauge

from hsx.dataset.draft_store import DraftStore
from hsx.local.spawn import HsxService
from hsx.runtime.errors import ExitCode, UsageError
from hsx.trainer.gate import outcome_counts

log = logging.getLogger(__name__)

TRAINER_STEP = Gauge("hsx_serve_trainer_step", "The trainer's latest training step")
TRAINER_LOSS = Gauge("hsx_serve_trainer_loss", "The trainer's loss at its latest step")
TRAINER_SAMPLES = Gauge("hsx_serve_trainer_samples", "Samples the trainer has trained on, this run of it")
GATE_DECISIONS = Gauge("hsx_serve_gate_decisions", "Checkpoints the gate judged, by outcome", ["outcome"])

STEP_LINE = re.compile(rb"step (\d+): loss (\S+), .*?(\d+) samples so far")
"""The trainer's line for each step (``hsx.trainer.online_trainer``)."""
METRICS_EVERY = 5.0
""":meth:`Learning.tick` reads the trainer's log and the gate's decisions this often, in seconds."""


@dataclass(frozen=True)
class LearnPlan:
    save_path: Path
    trainer_python: str
    checkpoint_every: int
    margin: float

    @property
    def drafts(self) -> Path:
        return self.save_path / "drafts"


def default_trainer_python() -> Path:
    """Where ``make speculators`` puts speculators' environment: beside this one."""
    return Path(sys.prefix).parent / ".venv-speculators" / "bin" / "python"


def learn_plan(save_path: str, trainer_python: str | None, checkpoint_every: int, margin: float) -> LearnPlan:
    """The loop's settings, checked before anything starts."""
    python = Path(trainer_python) if trainer_python else default_trainer_python()
    if not python.exists():
        raise UsageError(f"--learn trains with speculators, in an environment of its own: {python} does not exist "
                         "(`make speculators` builds .venv-speculators beside .venv; or give --trainer-python)")
    return LearnPlan(Path(save_path), str(python), checkpoint_every, margin)


class Learning:
    """Steps 2-4, beside a server that answers: call :meth:`tick` while it serves."""

    def __init__(self, plan: LearnPlan, store: DraftStore, draft: str, model: str, dataset: str, bootstrap: str,
                 ready_topic: str, logs: Path, accelerated: bool) -> None:
        """Step 2: ``hsx train-draft`` warm-started from the draft served now
        (``store``'s, the drafts store at ``plan.drafts``)."""
        self.store = store
        promoted = self.store.promoted()
        start = promoted.path if promoted is not None else draft
        cpu = [] if accelerated else ["--hidden-states-dtype", "float32", "--total-seq-len", "2048",
                                      "--num-workers", "1"]
        args = ["train-draft", "--bootstrap", bootstrap, "--ready-topic", ready_topic,
                "--group", f"learn-{ready_topic}", "--dataset", dataset, "--model", model,
                "--save-path", str(plan.save_path / "trainer" / ready_topic), "--init-from", start,
                "--promote-to", str(plan.drafts), "--margin", str(plan.margin),
                "--checkpoint-every", str(plan.checkpoint_every), *cpu]
        self.trainer = HsxService("trainer", args, logs, health=False, python=plan.trainer_python,
                                  with_parent=True).start()
        self.restarts = 0
        self._next_start = 0.0
        self._gave_up = False
        self._progress = TrainerProgress()
        self._next_metrics = 0.0

    def tick(self) -> None:
        """Step 3, and the learning metrics."""
        if time.monotonic() >= self._next_metrics:
            self._next_metrics = time.monotonic() + METRICS_EVERY
            self._progress.read(self.trainer.log_path())
            for outcome, count in outcome_counts(self.store.decisions()).items():
                GATE_DECISIONS.labels(outcome).set(count)
        status = self.trainer.exited()
        if status is None or time.monotonic() < self._next_start:
            return
        if status == ExitCode.USAGE:  # it refused its arguments: another start would too
            if not self._gave_up:
                log.error("the trainer refused its arguments (log: %s); serving on without learning",
                          self.trainer.log_path())
                self._gave_up = True
            return
        self.restarts += 1
        self._next_start = time.monotonic() + min(60.0, 2.0 ** self.restarts)
        log.error("the trainer exited with %s (log: %s); starting it again, from its last checkpoint", status,
                  self.trainer.log_path())
        self.trainer.start()

    def rows(self) -> list[tuple[str, str]]:
        """The summary's rows on learning."""
        counts = outcome_counts(self.store.decisions())
        return [("checkpoints judged", ", ".join(f"{n:,} {outcome}" for outcome, n in counts.items())),
                ("trainer restarts", f"{self.restarts:,}")]

    def stop(self) -> list[str]:
        """Step 4, the trainer's part: SIGTERM, a checkpoint and a commit; its failure, if any."""
        return self.trainer.drain(600, "the trainer")


class TrainerProgress:
    """The trainer's latest step and loss, from its log as it grows (each
    incarnation's log read from where the last read stopped)."""

    def __init__(self) -> None:
        self._path: Path | None = None
        self._offset = 0

    def read(self, log: Path) -> None:
        if log != self._path:
            self._path, self._offset = log, 0
        try:
            with log.open("rb") as source:
                source.seek(self._offset)
                text = source.read()
        except FileNotFoundError:
            return
        complete = text.rfind(b"\n") + 1  # a line still being written is read next time
        self._offset += complete
        steps = STEP_LINE.findall(text[:complete])
        if steps:
            step, loss, samples = steps[-1]
            TRAINER_STEP.set(int(step))
            TRAINER_LOSS.set(float(loss))
            TRAINER_SAMPLES.set(int(samples))
