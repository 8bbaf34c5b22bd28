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
3. On SIGTERM it is stopped first (it checkpoints, commits and judges what it
   trained), then the server drains.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

from hsx.local.spawn import HsxService, ServiceError
from hsx.runtime.draft_files import read_promoted
from hsx.runtime.errors import UsageError

FOREVER = 10**9
"""``--steps`` of a trainer that runs as long as the server does."""


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


def trainer(plan: LearnPlan, draft: str, model: str, dataset: str, bootstrap: str, ready_topic: str,
            logs: Path, accelerated: bool) -> HsxService:
    """Step 2: ``hsx train-draft`` warm-started from the draft served now."""
    promoted = read_promoted(plan.drafts)
    start = promoted.path if promoted is not None else draft
    cpu = [] if accelerated else ["--hidden-states-dtype", "float32", "--total-seq-len", "2048", "--num-workers", "1"]
    args = ["train-draft", "--bootstrap", bootstrap, "--ready-topic", ready_topic, "--group", f"learn-{ready_topic}",
            "--dataset", dataset, "--model", model, "--save-path", str(plan.save_path / "trainer" / ready_topic),
            "--init-from", start, "--promote-to", str(plan.drafts), "--margin", str(plan.margin),
            "--steps", str(FOREVER), "--checkpoint-every", str(plan.checkpoint_every), *cpu]
    return HsxService("trainer", args, logs, health=False, python=plan.trainer_python, with_parent=True).start()


def stop_trainer(service: HsxService) -> list[str]:
    """Step 3: SIGTERM, a checkpoint and a commit; its failure, if any."""
    if service.exited() is not None:
        return [f"the trainer exited with {service.exited()} (log: {service.log_path()})"]
    try:
        status = service.stop(timeout=600)
    except ServiceError as exc:
        return [str(exc).splitlines()[0]]
    return [] if status == 0 else [f"the trainer exited with {status} on SIGTERM (log: {service.log_path()})"]
