"""speculators' trainer without an accelerator: the three places of its
``Trainer`` that assume one, adapted, and nothing else.

speculators (0.9) is built for CUDA. On a CPU its ``Trainer``

1. sends the model and the batches to the local rank (an accelerator's index)
   and autocasts for ``"cuda"``: here they go to ``"cpu"`` and autocast is the CPU's;
2. has its step timer call ``torch.accelerator.synchronize()``, which raises
   without an accelerator: here it is skipped (CPU work is done when the call returns);
3. has its checkpointer load onto ``get_current_device()``, ``cuda:0`` without
   one: here onto the CPU.

Its defaults then need four flags: ``--draft-attn-impl sdpa`` (flex attention
has no CPU backward), ``--loss-implementation eager`` (the fused loss needs
Triton), ``--num-workers 1`` (its 12 data-loader workers, each a spawned
process importing torch, took a two-core machine minutes before the first step,
and the step, not the loading, is what a CPU waits for) and ``--optimizer adamw``
(its default Muon orthogonalizes each update in bfloat16, which CPUs without
bfloat16 units emulate: on two AVX2 cores, 200 SmolLM2 samples at 2,048 tokens,
the optimizer took 24.6-26.8 s of a 29.9-33.1 s step, AdamW 10-16 ms of
6.4-6.7 s); DFlash and P-EAGLE drafts (not EAGLE-3) also take ``--max-anchors
128``: speculators' 512 anchors are for its 8,192-token batches, a CPU packs
2,048 (the same anchors per token), and DFlash's logits are anchors x 16-token
blocks x the vocabulary, 1.6 GB a tensor for SmolLM2 at 512. :func:`main` adds
them when they are not given.

Offline training on an export (``hsx export --format speculators``), on a CPU::

    .venv-speculators/bin/python -m hsx.trainer.speculators_cpu --speculator-type eagle3 \\
        --verifier-name-or-path MODEL_DIR --data-path EXPORT --target-layer-ids 2 15 27 ...

takes exactly the flags of ``speculators train``. With an accelerator nothing is
changed (the command is then ``speculators train`` itself).
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Iterator

import torch

CPU_DEFAULTS = {"--draft-attn-impl": "sdpa", "--loss-implementation": "eager", "--num-workers": "1",
                "--optimizer": "adamw", "--max-anchors": "128"}
"""speculators' flags whose defaults need an accelerator, and what a CPU takes."""


@contextlib.contextmanager
def on_cpu() -> Iterator[None]:
    """speculators' ``Trainer`` (and any subclass made inside) runs on the CPU
    while this is open, where no accelerator is available; otherwise a no-op."""
    if torch.accelerator.is_available():
        yield
        return
    from speculators.train import checkpointer, trainer

    base = trainer.Trainer

    def setup_trainer(self: trainer.Trainer) -> None:  # type: ignore[name-defined]
        self.local_rank = "cpu"
        self.device_type = "cpu"
        original_setup(self)

    class CpuStepTimer(trainer._StepTimer):  # type: ignore[name-defined,misc]
        def mark(self, name: str) -> None:
            if self.enabled:
                self._marks[name] = time.perf_counter()

        def now(self) -> float | None:
            return time.perf_counter() if self.enabled else None

    original_setup = base.setup_trainer
    saved = trainer._StepTimer, checkpointer.get_current_device
    base.setup_trainer = setup_trainer
    trainer._StepTimer, checkpointer.get_current_device = CpuStepTimer, lambda: "cpu"
    try:
        yield
    finally:
        base.setup_trainer = original_setup
        trainer._StepTimer, checkpointer.get_current_device = saved


def with_cpu_defaults(argv: list[str]) -> list[str]:
    """``argv`` with :data:`CPU_DEFAULTS` added where neither is given."""
    given = {arg.split("=", 1)[0] for arg in argv}
    extra = [item for flag, value in CPU_DEFAULTS.items() if flag not in given for item in (flag, value)]
    return [*argv, *extra]


def main(argv: list[str] | None = None) -> None:
    """``speculators train`` with ``argv`` (its own flags), on the CPU where
    there is no accelerator."""
    from speculators.train.cli import main as speculators_main
    from speculators.train.config import TrainConfig

    argv = list(sys.argv[1:] if argv is None else argv)
    if not torch.accelerator.is_available():
        argv = with_cpu_defaults(argv)
    with on_cpu():
        speculators_main(TrainConfig.resolve(argv))


if __name__ == "__main__":
    main()
