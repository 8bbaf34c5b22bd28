"""speculators' own objects for ``hsx train-draft``, built from its flags as
``speculators train`` builds them from its own: the resolved ``TrainConfig``,
the draft model, and the ``TrainerConfig`` its ``Trainer`` takes.

Only the values the command sets are given; every other setting is
speculators' default for the draft type. Without an accelerator the four
defaults that need one take the CPU's (:data:`CPU_DEFAULTS`).
"""

from __future__ import annotations

import argparse
import math
from typing import Any

import torch

from hsx.runtime.draft_types import DraftType
from hsx.trainer.draft_checks import Resumed
from hsx.trainer.samples import LayerLayout
from hsx.trainer.speculators_cpu import CPU_DEFAULTS

UNTIL_STOPPED = 10**9
"""Epochs (of ``--checkpoint-every`` steps each) of a run without ``--steps``."""


def train_config(args: argparse.Namespace, kind: DraftType, layout: LayerLayout, resumed: Resumed | None) -> Any:
    """speculators' ``TrainConfig`` for this run, saved as its ``run.yaml``."""
    from speculators.train.config import TrainConfig

    accelerated = torch.accelerator.is_available()
    save = str(args.save_path)
    return TrainConfig.from_flat({
        "speculator_type": kind.name, "seed": args.seed, "verifier_name_or_path": str(args.model.resolve()),
        "target_layer_ids": list(layout.aux), "draft_vocab_size": args.draft_vocab_size,
        # speculators keeps token_freq.pt and its cached d2t/t2d mapping in data_path
        "data_path": save, "save_path": save, "total_seq_len": args.total_seq_len,
        "hidden_states_dtype": args.hidden_states_dtype, "lr": args.lr, "num_workers": args.num_workers,
        "draft_attn_impl": args.draft_attn_impl or _default("--draft-attn-impl", "simple_flex_attention"),
        "loss_implementation": args.loss_implementation or _default("--loss-implementation", "fused"),
        "optimizer": args.optimizer or _default("--optimizer", "muon"),
        **({} if accelerated else {"max_anchors": int(CPU_DEFAULTS["--max-anchors"])}),
        "epochs": _epochs(args.steps, args.checkpoint_every, resumed), "checkpoint_freq": 1,
        "max_steps": args.steps,
        # A schedule over steps no one knows would warm up for ever (1 % of them): constant instead.
        **({"scheduler_type": "none"} if args.steps is None else {}),
        # --init-from: the draft's own config, weights and vocabulary mapping (its d2t and t2d tensors).
        **({"from_pretrained": str(args.init_from.resolve()), "draft_vocab_size": None} if args.init_from else {})})


def _default(flag: str, accelerated: str) -> str:
    """speculators' default for ``flag`` with an accelerator, else the CPU's (:data:`CPU_DEFAULTS`)."""
    return accelerated if torch.accelerator.is_available() else CPU_DEFAULTS[flag]


def _epochs(steps: int | None, checkpoint_every: int, resumed: Resumed | None) -> int:
    """Epochs in all: speculators resumes at the epoch after the last checkpoint,
    which may have ended early (the stream went idle), so the epochs left are
    counted from the steps left."""
    if steps is None:
        return UNTIL_STOPPED
    done_epochs, done_steps = (resumed.epoch + 1, resumed.global_step) if resumed else (0, 0)
    return done_epochs + max(0, math.ceil((steps - done_steps) / checkpoint_every))


def draft_model(spec: argparse.Namespace, kind: DraftType, warm_start: bool) -> tuple[torch.nn.Module, Any]:
    """The draft and its class, as speculators' ``main()`` builds them
    (vocabulary mapping, ``--from-pretrained``), in float32."""
    from speculators.model import SpeculatorModel
    from speculators.train.cli import build_draft_model, parse_vocab_mappings

    d2t, t2d, draft_vocab_size = parse_vocab_mappings(spec)
    model_class = SpeculatorModel.registry[kind.name]
    model = build_draft_model(spec, model_class, t2d, d2t, draft_vocab_size)
    if warm_start:  # weights in float32, as a new draft's, whatever dtype it was saved in (bf16)
        model = model.float()
    return model, model_class


def trainer_config(spec: argparse.Namespace, model_class: Any, dtype: torch.dtype) -> Any:
    """speculators' ``TrainerConfig``, as its own ``main()`` builds it from the same resolved config."""
    from speculators.train.trainer import TrainerConfig

    train_kwargs, val_kwargs = model_class.get_trainer_kwargs(**vars(spec))
    return TrainerConfig(
        num_epochs=spec.epochs, save_path=spec.save_path, lr=spec.lr,
        resume_from_checkpoint=not spec.no_resume_from_checkpoint,
        train_call_kwargs=train_kwargs, val_call_kwargs=val_kwargs, optimizer=spec.optimizer,
        weight_decay=spec.weight_decay, muon_lr=spec.muon_lr, muon_momentum=spec.muon_momentum,
        muon_weight_decay=spec.muon_weight_decay, muon_ns_steps=spec.muon_ns_steps,
        muon_adjust_lr_fn=spec.muon_adjust_lr_fn, scheduler_type=spec.scheduler_type,
        scheduler_warmup_steps=spec.scheduler_warmup_steps, scheduler_warmup_ratio=spec.scheduler_warmup_ratio,
        scheduler_total_steps=spec.scheduler_total_steps,
        scheduler_num_cosine_cycles=spec.scheduler_num_cosine_cycles, checkpoint_freq=spec.checkpoint_freq,
        save_best=spec.save_best, hidden_states_dtype=dtype, log_freq=spec.log_freq, fsdp_shard=spec.fsdp_shard,
        gradient_checkpointing=spec.gradient_checkpointing, max_steps=spec.max_steps)
