"""``hsx train-draft``: train a speculators draft online (EAGLE-3 by default,
``--speculator-type dflash`` or ``peagle``), from ``hidden_states.ready`` while
extraction runs: no export, no second pass.

It runs where speculators (0.9) is installed with hsx beside it (``make
speculators`` builds such an environment: ``.venv-speculators/bin/hsx``); hsx's
vLLM environment lacks speculators, and this command then says so in one line.

What is speculators' own, unchanged:

- **The draft**: built by ``speculators.train.cli.build_draft_model`` from a
  ``TrainConfig`` holding only the values given here, so every other setting
  (for EAGLE-3 one llama decoder layer, norms, muon optimizer, linear schedule,
  kl_div loss, 3 TTT steps, ...; for DFlash five qwen3 layers, 16-token blocks,
  ...) is the default of ``speculators train --speculator-type T``;
  ``SAVE/run.yaml`` records the config as speculators does.
- **The draft vocabulary**: ``--draft-vocab-size N`` builds it with speculators'
  ``parse_vocab_mappings`` from ``SAVE/token_freq.pt`` (cached as
  ``SAVE/d2t-N.npy``, ``SAVE/t2d-N.npy``). An online job has no dataset to count
  beforehand, and the draft's output layer is sized by the vocabulary before its
  first step, so the counts are taken from the first ``--vocab-samples``
  samples of the stream (their token ids and masks only, not their hidden
  states), the same samples it then trains on first. Without
  ``--draft-vocab-size`` the draft predicts the verifier's full vocabulary,
  speculators' own default.
- **The step and the checkpoints**: speculators' ``Trainer`` (forward, loss,
  clipping, optimizer, schedule, ``SingleGPUCheckpointer``); batches are its
  ``CollateFn`` (with EAGLE-3's ``shift_batch`` for EAGLE-3 and P-EAGLE), the
  layout ``speculators train`` feeds it, built from hsx samples as its
  ``ArrowDataset`` builds them from an export. ``SAVE/<n>/`` is what
  ``speculators train`` writes for epoch ``n`` (``config.json``,
  ``model.safetensors``, optimizer and scheduler state,
  ``training_state.json``), and vLLM serves it as ``vllm serve SAVE/<n>`` would
  (``hsx eval-draft --draft SAVE/<n>``: the method read from its config).

What is hsx's:

- **Epochs** are chunks of ``--checkpoint-every`` steps (a stream has no end and
  no length; speculators' Trainer counts an epoch over ``len(train_loader)``),
  each ending with a checkpoint, ``--steps`` in all.
- **Batches** pack samples in arrival order into ``--total-seq-len`` tokens; a
  sample that does not fit starts the next batch, so none is cut but one longer
  than a whole batch (speculators' collate cuts it). A batch goes to the trainer
  once full, or when the stream goes idle.
- **Offsets** are committed to the job's group (``--group``) after each
  checkpoint, for the samples of the steps it holds, and the stream's position
  is saved with it (``SAVE/<n>/hsx_stream.json``). A restart resumes speculators'
  checkpoint and its stream position: the samples trained after that checkpoint
  are trained again, none is skipped (committing before the checkpoint would
  skip them: the weights that learned them are lost with the process).
- **SIGTERM or Ctrl-C** drains: the step in progress finishes, a checkpoint is
  written, the offsets committed, exit 0 (a second signal stops at once).
  speculators' own handler instead saves ``interrupted/``, which it never resumes.

**Warm start and the gate** (the learning loop with ``hsx serve --draft D
--drafts DIR``): ``--init-from D`` starts from the served draft (its weights,
vocabulary mapping and config: speculators' ``--from-pretrained``), so every
checkpoint is a drop-in for that server; ``--promote-to DIR`` keeps a share of
the samples out of training (``--holdout``) and judges each checkpoint on the
most recent of them against the draft promoted in ``DIR`` (:mod:`hsx.trainer.gate`),
promoting it there when better by ``--margin``.

**Without an accelerator** (CPU), speculators' Trainer is adapted in the three
places that assume one, and nowhere else (:mod:`hsx.trainer.speculators_cpu`,
which ``speculators train`` on an export uses too). The defaults then take
``sdpa`` attention (flex attention has no CPU backward) and the eager loss (the
fused one needs Triton). On a GPU nothing is changed.
"""

from __future__ import annotations

import argparse
import logging
import signal
from pathlib import Path

import torch
import torch.utils.data

from hsx.dataset.reader import MissingShard, ShardHandles
from hsx.dataset.storage import is_object_store, open_storage
from hsx.runtime.checks import integer, number
from hsx.runtime.draft_types import TYPES
from hsx.runtime.errors import ServiceFailed
from hsx.runtime.kafka import ensure_topics
from hsx.runtime.kafka.admin import add_connect_timeout
from hsx.runtime.logs import redact_secrets
from hsx.runtime.settings import KafkaSettings, TopicSettings, overrides
from hsx.trainer.draft_checks import (Resumed, check_command_line, check_layout, check_resumed, check_resumed_layers,
                                      last_checkpoint)
from hsx.trainer.first_samples import first_samples
from hsx.trainer.gate import Gate
from hsx.trainer.online import ReadyStream
from hsx.trainer.online_trainer import StepLog, online_trainer_class
from hsx.trainer.samples import LayerLayout, layer_list
from hsx.trainer.speculators_cpu import on_cpu
from hsx.trainer.speculators_setup import draft_model, train_config, trainer_config
from hsx.trainer.stream_batches import PackedSamples, SpeculatorsBatch, StreamEpochs

log = logging.getLogger(__name__)

TOKEN_FREQ = "token_freq.pt"
"""speculators' name for the token counts its vocabulary mapping is built from."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--bootstrap", help="bootstrap servers (env HSX_KAFKA_BOOTSTRAP)")
    add_connect_timeout(parser, None)
    parser.add_argument("--ready-topic", help="ready events topic (env HSX_TOPIC_READY)")
    parser.add_argument("--group", required=True,
                        help="this training job's consumer group: its commits are the job's position")
    parser.add_argument("--dataset", required=True,
                        help="the dataset hsx sink writes (its --output: a directory or s3://BUCKET/PREFIX)")
    parser.add_argument("--model", required=True, type=Path,
                        help="the verifier: the local model directory given to hsx extract")
    parser.add_argument("--save-path", required=True, type=Path,
                        help="checkpoint directory (speculators' layout: SAVE/<n>/ every --checkpoint-every "
                             "steps); a run with one there resumes from its last checkpoint")
    parser.add_argument("--steps", type=integer(1), metavar="N",
                        help="optimizer steps in all (a resumed run counts the steps before it), the learning rate "
                             "warmed up and decayed over them; default: train until stopped (SIGTERM), at a constant "
                             "learning rate (the online loop: hsx serve --learn, the trainer Deployment)")
    parser.add_argument("--checkpoint-every", type=integer(1), default=500, metavar="N",
                        help="steps per checkpoint; the offsets are committed after each (default %(default)s)")
    parser.add_argument("--max-samples", type=integer(1), metavar="M",
                        help="stop after the step that reaches M samples in this run (default: no limit)")
    parser.add_argument("--exit-when-idle", type=number(0), metavar="SECS",
                        help="stop (checkpoint, commit, exit 0) after SECS without a ready event "
                             "(default: wait for ever, as extraction may resume)")
    parser.add_argument("--layers", type=layer_list, default=None,
                        help="aux layer ids in the draft's order (its target_layer_ids), e.g. 2,15,27 "
                             "(default: every stored layer but the last, ascending)")
    parser.add_argument("--loss-mask", choices=["all", "none"], default="all",
                        help="loss mask of samples stored without one (plain text): all = every token, "
                             "none = no token (such samples are skipped); default all")
    parser.add_argument("--speculator-type", default="eagle3", metavar="TYPE",
                        help=f"the draft type: {', '.join(TYPES)} (default %(default)s; speculators' own model, "
                             "step and defaults for it)")
    parser.add_argument("--init-from", type=Path, metavar="DRAFT",
                        help="warm-start from this checkpoint of --speculator-type (its weights, vocabulary mapping "
                             "and config: e.g. the draft a server serves), so each checkpoint is a drop-in for it; "
                             "speculators' "
                             "--from-pretrained (default: a new draft)")
    gate = parser.add_argument_group("the gate (with --init-from: judge each checkpoint against the served draft)")
    gate.add_argument("--promote-to", metavar="DIR|s3://BUCKET/PREFIX",
                      help="the drafts store servers follow (hsx serve --drafts): a directory, or an object store "
                           "the promoted checkpoints are uploaded to; each checkpoint is scored against the draft "
                           "promoted there (else --init-from) on held-out served samples and promoted when better "
                           "by --margin; decisions in its decisions.jsonl")
    gate.add_argument("--holdout", type=number(0), default=0.1, metavar="SHARE",
                      help="with --promote-to: the share of sample ids kept out of training for the gate "
                           "(by hash; default %(default)s)")
    gate.add_argument("--gate-samples", type=integer(1), default=64, metavar="N",
                      help="the most recent held-out samples a checkpoint is scored on (default %(default)s)")
    gate.add_argument("--margin", type=number(0), default=0.05,
                      help="acceptance length a checkpoint must gain over the served draft (default %(default)s)")
    parser.add_argument("--draft-vocab-size", type=integer(1), metavar="N",
                        help="the draft's vocabulary: the N tokens most frequent in the first --vocab-samples "
                             "samples (default: the verifier's full vocabulary)")
    parser.add_argument("--vocab-samples", type=integer(1), default=1000, metavar="K",
                        help="samples whose supervised tokens are counted for --draft-vocab-size "
                             "(default %(default)s; fewer when the stream goes idle first)")
    parser.add_argument("--total-seq-len", type=integer(2), default=8192, metavar="T",
                        help="tokens per batch, samples packed (default %(default)s, speculators' default)")
    parser.add_argument("--hidden-states-dtype", choices=["bfloat16", "float32"], default="bfloat16",
                        help="batches and autocast (default %(default)s; float32 on CPUs without bf16)")
    parser.add_argument("--lr", type=number(above=0), default=1e-3, help="learning rate (default %(default)s)")
    parser.add_argument("--seed", type=integer(0), default=42, help="random seed (default %(default)s)")
    parser.add_argument("--draft-attn-impl", choices=["simple_flex_attention", "sdpa", "eager"],
                        help="draft attention (default: simple_flex_attention with an accelerator, "
                             "sdpa without one: flex attention has no CPU backward)")
    parser.add_argument("--loss-implementation", choices=["fused", "eager"],
                        help="loss (default: fused with an accelerator, eager without one: fused needs Triton)")
    parser.add_argument("--optimizer", choices=["muon", "adamw"],
                        help="optimizer (default: speculators' muon with an accelerator, adamw without one: muon "
                             "orthogonalizes in bfloat16, which took 25 of a 30 s step on two cores without bf16 units)")
    parser.add_argument("--num-workers", type=integer(0), default=2,
                        help="DataLoader workers reading samples (default %(default)s)")
    parser.add_argument("--shuffle-buffer", type=integer(0), default=0, metavar="N",
                        help="samples shuffled within a window of N events (default 0: arrival order)")


# --- the command -------------------------------------------------------------------------------

def run(args: argparse.Namespace) -> int:
    config = check_command_line(args)
    kafka = KafkaSettings(**overrides(bootstrap=args.bootstrap))
    redact_secrets(kafka.secret_values())
    topics = TopicSettings(**overrides(ready=args.ready_topic))
    ensure_topics(kafka, topics, [topics.ready], timeout=args.connect_timeout)  # a job may start before the sink
    save: Path = args.save_path
    save.mkdir(parents=True, exist_ok=True)
    resumed = last_checkpoint(save)
    if resumed is not None:
        check_resumed(save, resumed, topics.ready, args.group, args.draft_vocab_size or int(config["vocab_size"]))
    count_vocab = args.draft_vocab_size is not None and args.init_from is None and not (save / TOKEN_FREQ).exists()
    shards = ShardHandles(open_storage(args.dataset, create=True))  # the sink may not have made it yet
    wanted = args.vocab_samples if count_vocab else 1
    log.info("waiting for the first %d sample(s) of %s (%s)", wanted, topics.ready,
             "layout and draft vocabulary" if count_vocab else "layout")
    try:
        first = first_samples(kafka, topics.ready, args.group, shards, wanted, args.loss_mask, args.exit_when_idle)
    except (MissingShard, ValueError) as exc:  # a shard not in --dataset, a sample no trainer can use
        raise ServiceFailed(str(exc)) from exc
    if not first.events:
        print(f"train-draft: no sample arrived in {args.exit_when_idle:g}s (--exit-when-idle); nothing trained")
        return 0
    layout = check_layout(first.events[0], args, config)
    if resumed is not None:
        check_resumed_layers(save, resumed, layout)
    if count_vocab:
        torch.save(dict(first.token_freq), save / TOKEN_FREQ)
        log.info("draft vocabulary: %d distinct tokens in %d samples", len(first.token_freq), len(first.events))
    return _train(args, layout, int(config["hidden_size"]), kafka, topics.ready, resumed)


def _train(args: argparse.Namespace, layout: LayerLayout, hidden_size: int, kafka: KafkaSettings, topic: str,
           resumed: Resumed | None) -> int:
    from speculators.train.cli import set_seed

    kind = TYPES[args.speculator_type]
    accelerated = torch.accelerator.is_available()
    cfg = train_config(args, kind, layout, resumed)
    spec = argparse.Namespace(**cfg.flatten())
    set_seed(spec.seed)
    cfg.save(str(args.save_path))
    model, model_class = draft_model(spec, kind, warm_start=args.init_from is not None)
    dtype = getattr(torch, spec.hidden_states_dtype)
    config = trainer_config(spec, model_class, dtype)

    holdout = args.holdout if args.promote_to is not None else 0.0
    stream = ReadyStream(kafka.bootstrap, args.dataset, args.group, topic=topic, layers=list(layout.aux),
                         loss_mask=args.loss_mask, shuffle_buffer=args.shuffle_buffer, seed=args.seed,
                         idle_timeout=args.exit_when_idle, holdout=holdout, kafka=kafka)
    gate = None if args.promote_to is None else Gate(
        args.promote_to, args.init_from, args.dataset, args.model, share=holdout, samples=args.gate_samples,
        margin=args.margin, layers=list(layout.aux), total_seq_len=args.total_seq_len, dtype=dtype,
        ttt_steps=spec.ttt_steps, attn_impl=spec.draft_attn_impl)
    loader = torch.utils.data.DataLoader(
        PackedSamples(stream, args.total_seq_len, kind.shifted), batch_size=None, num_workers=args.num_workers,
        collate_fn=SpeculatorsBatch(args.total_seq_len, hidden_size, len(layout.aux), dtype, kind.shifted),
        pin_memory=accelerated,  # as speculators' own loader, for the copy to the accelerator
        # the object-store client does not survive fork() (hsx.trainer.online)
        multiprocessing_context="forkserver" if args.num_workers and is_object_store(args.dataset) else None)
    epochs_view = StreamEpochs(loader, args.checkpoint_every, args.max_samples)
    steps_log = StepLog(epochs_view)
    metrics = logging.getLogger("speculators.metrics")
    metrics.addHandler(steps_log)
    metrics.propagate = False  # its dicts become StepLog's lines, not dict reprs in the log
    with on_cpu():
        trainer = online_trainer_class()(model, config, epochs_view, stream,
                                         gate.judge if gate is not None else None)
        if resumed is not None and resumed.stream is not None:
            stream.load_state_dict(resumed.stream)
        before = trainer.global_step
        handlers = {sig: signal.signal(sig, epochs_view.ask_stop) for sig in (signal.SIGTERM, signal.SIGINT)}
        try:
            trainer.run_training()
        except (MissingShard, ValueError, ConnectionError) as exc:  # the stream's, through a DataLoader worker too
            raise ServiceFailed(str(exc).strip().splitlines()[-1]) from exc
        finally:
            stream.close()
            for sig, handler in handlers.items():
                signal.signal(sig, handler)
    steps = trainer.global_step - before
    why = epochs_view.ended or "--steps reached"
    if not steps:
        print(f"train-draft: nothing trained ({why}; {before} steps before this run)")
        return 0
    seconds = epochs_view.training_seconds
    print(f"train-draft: {steps} steps on {epochs_view.handed_out} samples in {seconds:.1f}s "
          f"({seconds / steps:.2f} s/step), loss {steps_log.losses[0]:.4f} -> {steps_log.losses[-1]:.4f}; "
          f"{why}; step {trainer.global_step}, checkpoint {trainer.saved}")
    if args.steps is not None and trainer.global_step < args.steps:  # warm-up and decay were laid out over --steps
        log.warning("the learning rate's schedule spans --steps %d and training stopped at step %d (%.0f %%): for a "
                    "draft trained to the end of its schedule, give --steps about the steps the stream makes",
                    args.steps, trainer.global_step, 100 * trainer.global_step / args.steps)
    return 0
