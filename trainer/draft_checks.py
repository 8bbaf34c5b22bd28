"""What ``hsx train-draft`` checks before it trains, each failure one line
(:class:`UsageError`): the command line against the verifier (before Kafka or
speculators is touched), the stream's first samples against the verifier, and
the checkpoint a run resumes against this run.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hsx.dataset.storage import is_object_store
from hsx.runtime.checks import model_dir, outside, writable_dir
from hsx.runtime.draft_checkpoint import read_draft
from hsx.runtime.draft_types import draft_type
from hsx.runtime.errors import UsageError
from hsx.schemas import HiddenStatesReady
from hsx.trainer.samples import LayerLayout, choose_layers

log = logging.getLogger(__name__)

STREAM_STATE = "hsx_stream.json"
"""The stream's position (``ReadyStream.state_dict``) in each checkpoint directory."""


def check_command_line(args: argparse.Namespace) -> dict[str, Any]:
    """Every check that needs neither Kafka nor speculators' model code, in one
    line each; returns the verifier's (text) config."""
    model_dir("--model", args.model)
    config = json.loads((args.model / "config.json").read_text())
    config = config.get("text_config", config)
    if not is_object_store(args.dataset):
        dataset = Path(args.dataset)
        if not dataset.is_dir() and not dataset.parent.is_dir():  # a job may start before the sink makes it
            raise UsageError(f"--dataset {args.dataset}: no such directory, nor its parent (the sink's --output)")
        outside("--save-path", args.save_path, "--dataset", dataset)
    writable_dir("--save-path", args.save_path)
    vocab = int(config["vocab_size"])
    if args.draft_vocab_size is not None and args.draft_vocab_size > vocab:
        raise UsageError(f"--draft-vocab-size {args.draft_vocab_size}: more than the verifier's vocabulary ({vocab})")
    layers = int(config["num_hidden_layers"])
    if args.layers is not None and max(args.layers) >= layers:
        raise UsageError(f"--layers {','.join(map(str, args.layers))}: the verifier has {layers} layers, so aux "
                         f"layer ids are 0..{layers - 1}")
    kind = draft_type("--speculator-type", args.speculator_type)
    if args.init_from is not None:
        check_init_from(args, config)
    if args.promote_to is not None:
        if kind.name != "eagle3":
            raise UsageError(f"--promote-to with --speculator-type {kind.name}: the gate scores EAGLE-3 drafts only "
                             "(their teacher-forced acceptance by position); train without --promote-to and measure "
                             "checkpoints with hsx eval-draft")
        if args.init_from is None:
            raise UsageError("--promote-to judges checkpoints against the draft servers serve: give --init-from "
                             "that draft, so each checkpoint is a drop-in for it")
        if not 0 < args.holdout < 1:
            raise UsageError(f"--holdout {args.holdout}: a share between 0 and 1 (exclusive) of samples to judge on")
        if not is_object_store(args.promote_to):
            writable_dir("--promote-to", Path(args.promote_to))
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise UsageError("runs as one process (one GPU or the CPU); torchrun is not supported yet")
    if importlib.util.find_spec("speculators") is None:
        raise UsageError("needs speculators beside hsx (speculators==0.9.0, with hsx installed in its "
                         "environment: `make speculators`, then .venv-speculators/bin/hsx train-draft)")
    return config


def check_init_from(args: argparse.Namespace, verifier: dict[str, Any]) -> None:
    """``--init-from``: a checkpoint of ``--speculator-type`` for this verifier,
    whose vocabulary and aux layers the run keeps (``--draft-vocab-size`` and
    other ``--layers`` would make checkpoints the serving draft's server cannot
    swap in). Sets ``args.layers`` and ``args.draft_vocab_size`` to the draft's."""
    draft = read_draft("--init-from", args.init_from, (args.speculator_type,))
    flag = f"--init-from {args.init_from}"
    if draft.vocab_size != verifier["vocab_size"]:
        raise UsageError(f"{flag}: a draft for a vocabulary of {draft.vocab_size} tokens, the verifier has "
                         f"{verifier['vocab_size']}")
    aux = draft.aux_layer_ids
    if aux is None:
        raise UsageError(f"{flag}: its config names no {draft.kind.aux_key}")
    if args.layers is not None and list(args.layers) != aux:
        raise UsageError(f"{flag} reads aux layers {aux}: drop --layers (or give {','.join(map(str, aux))})")
    if args.draft_vocab_size is not None:
        raise UsageError(f"{flag} keeps the draft's vocabulary ({draft.draft_vocab_size} tokens and its mapping): "
                         "drop --draft-vocab-size")
    args.layers = aux
    args.draft_vocab_size = draft.draft_vocab_size


def check_layout(first: HiddenStatesReady, args: argparse.Namespace, config: dict[str, Any]) -> LayerLayout:
    """The aux layers to train on, checked against the verifier: speculators
    takes the last slot as the verifier's last layer before its final norm,
    which is hsx's layer id ``num_hidden_layers``."""
    try:
        layout = choose_layers(first.layer_ids, args.layers)
    except ValueError as exc:
        raise UsageError(f"the stream's samples: {exc}") from None
    if layout.verifier != int(config["num_hidden_layers"]):
        raise UsageError(f"the stream's samples store layers {first.layer_ids}, the highest {layout.verifier}; the "
                         f"draft needs the verifier's last layer ({config['num_hidden_layers']}): extract with it")
    if first.hidden_size != int(config["hidden_size"]):
        raise UsageError(f"the stream's samples are {first.hidden_size} wide, --model {args.model} is "
                         f"{config['hidden_size']}: not the verifier they were extracted from")
    if Path(first.model).resolve() != args.model.resolve() and first.model != args.model.name:
        log.warning("the stream's samples name model %s; training for --model %s", first.model, args.model)
    return layout


@dataclass(frozen=True)
class Resumed:
    """The checkpoint a run resumes: the last epoch directory in ``--save-path``,
    as speculators' checkpointer picks it."""

    epoch: int
    global_step: int
    config: dict[str, Any]
    stream: dict[str, Any] | None
    """Its ``hsx_stream.json`` (absent in a checkpoint of ``speculators train``)."""


def last_checkpoint(save_path: Path) -> Resumed | None:
    epochs = [int(p.name) for p in save_path.glob("*") if p.name.isdigit() and p.is_dir() and not p.is_symlink()]
    if not epochs:
        return None
    last = save_path / str(max(epochs))
    stream = json.loads((last / STREAM_STATE).read_text()) if (last / STREAM_STATE).exists() else None
    return Resumed(max(epochs), int(json.loads((last / "training_state.json").read_text())["global_step"]),
                   json.loads((last / "config.json").read_text()), stream)


def check_resumed(save_path: Path, resumed: Resumed, topic: str, group: str, draft_vocab_size: int) -> None:
    """A run resuming a checkpoint reads the stream it was trained from and
    builds a draft of the same vocabulary."""
    if resumed.stream is not None and (resumed.stream["topic"], resumed.stream["group_id"]) != (topic, group):
        raise UsageError(f"--save-path {save_path}: its checkpoints were trained from {resumed.stream['topic']} as "
                         f"group {resumed.stream['group_id']}; give that --ready-topic and --group, or a new "
                         "--save-path")
    if resumed.config["draft_vocab_size"] != draft_vocab_size:
        raise UsageError(f"--save-path {save_path}: its checkpoints have a draft vocabulary of "
                         f"{resumed.config['draft_vocab_size']} tokens, this run {draft_vocab_size}; give the same "
                         "--draft-vocab-size or a new --save-path")


def check_resumed_layers(save_path: Path, resumed: Resumed, layout: LayerLayout) -> None:
    """... and feeds it the same aux layers."""
    aux = resumed.config["eagle_aux_hidden_state_layer_ids"]
    if aux != list(layout.aux):
        raise UsageError(f"--save-path {save_path}: its checkpoints feed aux layers {aux}, this run "
                         f"{list(layout.aux)}; give --layers {','.join(map(str, aux))} or a new --save-path")
