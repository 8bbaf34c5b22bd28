"""What ``hsx serve`` needs, checked before anything starts (:class:`ServePlan`,
step 1 of :mod:`hsx.serving.command`), and where it puts what it stages and logs."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hsx.dataset.draft_store import DraftStore
from hsx.dataset.storage import is_object_store
from hsx.extractor.cli import check_layout, model_and_layers
from hsx.extractor.engine import EngineOptions
from hsx.runtime.checks import model_dir, writable_dir
from hsx.runtime.draft_checkpoint import check_verifier, read_draft
from hsx.runtime.errors import UsageError
from hsx.runtime.settings import from_args
from hsx.schemas.dataset_codec import DatasetCodec
from hsx.serving.learning import LearnPlan, learn_plan


@dataclass
class ServePlan:
    """What ``hsx serve`` needs, checked before anything starts (step 1)."""

    engine: EngineOptions
    host: str
    port: int
    health_port: int
    shutdown_timeout: int
    files: str | None
    files_ttl: float
    files_max_bytes: int
    output: str | None
    bootstrap: str | None
    own_sink: bool
    """Whether the dataset side starts a sink of its own (``--output``) or only
    sends to the cluster's sinks (``--no-sink``)."""
    dataset_codec: DatasetCodec
    inline: bool
    model_name: str | None
    api_key: str | None
    drafts: str | None = None
    """The drafts directory whose promoted drafts the server swaps in (``--drafts``)."""
    learn: LearnPlan | None = None
    """``--learn``: a trainer beside the server, promoting to ``drafts`` (:mod:`hsx.serving.learning`)."""

    @property
    def sends(self) -> bool:
        """Whether responses' hidden states go to Kafka (the dataset side)."""
        return self.output is not None or not self.own_sink

    @property
    def staging(self) -> str | None:
        """Where the connector stages hidden states for the sink; ``None``: inline."""
        if self.output is None or self.inline or is_object_store(self.output):
            return None
        return str(Path(self.output) / "staging")

    @property
    def logs(self) -> Path:
        if self.output is not None and not is_object_store(self.output):
            return Path(self.output) / "logs"
        return Path("hsx-logs") / "serve"


def plan_from_args(args: argparse.Namespace) -> ServePlan:
    """Step 1: every local argument checked; ``UsageError`` in one line."""
    if args.shared_storage_path is None and args.output is None and not args.no_sink:
        raise UsageError("give --shared-storage-path DIR (a file per response), --output DATASET, or both")
    if args.no_sink and args.output is not None:
        raise UsageError("--no-sink sends to the cluster's sinks, which write their own dataset: drop --output")
    if args.no_sink and not (args.bootstrap or os.environ.get("HSX_KAFKA_BOOTSTRAP")):
        raise UsageError("--no-sink needs the cluster: --bootstrap or HSX_KAFKA_BOOTSTRAP")
    check_layout(args)
    model_dir("--model", Path(args.model))
    config, layers = model_and_layers(args)
    if args.draft is not None:
        layers = draft_layers(args, config)
    learn = None
    if args.learn:
        if args.draft is None or args.save_path is None or args.output is None:
            raise UsageError("--learn trains the draft the server serves on the samples it captures: give --draft, "
                             "--output (the dataset) and --save-path (checkpoints and promoted drafts)")
        if args.drafts is not None:
            raise UsageError("--learn promotes to SAVE_PATH/drafts, which the server follows: drop --drafts")
        writable_dir("--save-path", Path(args.save_path))
        learn = learn_plan(args.save_path, args.trainer_python, args.checkpoint_every, args.margin)
        args.drafts = str(learn.drafts)
    if args.drafts is not None:
        if args.draft is None:
            raise UsageError("--drafts swaps promoted drafts in for the one a server starts with: give --draft too")
        if is_object_store(args.drafts):
            DraftStore(args.drafts)  # one request: a wrong bucket or key is refused here, in one line
        else:
            writable_dir("--drafts", Path(args.drafts))
    if args.shared_storage_path is not None:
        writable_dir("--shared-storage-path", Path(args.shared_storage_path))
    if args.output is not None and not is_object_store(args.output):
        writable_dir("--output", Path(args.output))
    engine = from_args(EngineOptions, args, layer_ids=layers, engine_args=dict(args.engine_arg),
                       draft=None if args.draft is None else str(Path(args.draft).resolve()))
    return ServePlan(engine=engine, host=args.host, port=args.port,
                     health_port=args.health_port if args.health_port is not None else args.port + 1,
                     shutdown_timeout=args.shutdown_timeout, files=args.shared_storage_path,
                     files_ttl=args.files_ttl, files_max_bytes=args.files_max_bytes, output=args.output,
                     bootstrap=args.bootstrap, own_sink=not args.no_sink,
                     dataset_codec=DatasetCodec(args.dataset_codec), inline=args.inline,
                     model_name=args.model_name, api_key=args.api_key or os.environ.get("VLLM_API_KEY"),
                     drafts=args.drafts, learn=learn)


def draft_layers(args: argparse.Namespace, verifier: Any) -> list[int]:
    """``--draft``'s checkpoint checked against the verifier's text config; the
    layers its samples hold: the draft's aux layers, then the verifier's last."""
    if args.layers is not None:
        raise UsageError("--layers and --draft: with a draft the captured layers are the draft's aux layers and the "
                         "last (a sample is what that draft trains on); drop --layers")
    draft = read_draft("--draft", args.draft, ("eagle3",))
    check_verifier("--draft", draft, verifier)
    if draft.aux_layer_ids is None:
        raise UsageError(f"--draft {args.draft}: its config.json names no eagle_aux_hidden_state_layer_ids, so the "
                         "layers it reads are the engine's choice; hsx captures the layers a draft names")
    return sorted({*draft.aux_layer_ids, verifier.num_hidden_layers})
