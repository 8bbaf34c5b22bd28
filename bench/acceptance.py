"""The acceptance benchmark: drafts trained on hsx data (EAGLE-3, DFlash,
P-EAGLE), measured where it counts, by the tokens vLLM's speculative decoding
accepts on prompts training never saw (SmolLM2-135M-Instruct, CPU, greedy;
EAGLE-3 at 3 speculative tokens, the others at their checkpoints').

Stages, each run once and resumed where it stopped (its figures go to
``WORK/figures/STAGE.json`` when it is done; a stage runs the ones it needs):

1. ``corpus``: ``bench.acceptance_corpus``: 2,400 training chats from the
   installed packages' documentation, 120 evaluation chats from CPython's help
   topics;
2. ``data``: ``hsx run train.jsonl --generate max_tokens=128``: the verifier
   answers every chat and its hidden states are captured in the same pass;
3. ``export``: ``hsx export --format speculators``;
4. arms, trained with the same flags (the command ``hsx export`` prints, with
   :data:`TRAIN_FLAGS`), each measured by ``hsx eval-draft`` on the evaluation set:

   - ``untrained``: speculators' ``--dry-run`` draft (the floor, about 1.0);
   - ``offline``: (a) speculators' own ``train`` on the export (through
     ``hsx.trainer.speculators_cpu`` where there is no accelerator), measured
     after 1, 2 and 4 of its 4 epochs: the learning curve at 25, 50 and 100 %
     of the training tokens;
   - ``float32``: (a)'s draft measured again with ``--dtype float32``: are the
     greedy outputs that differ with a draft in bfloat16 the verifier's numerics?
   - ``reference``: (c) the export's token sequences and loss masks with hidden
     states computed by HF transformers (``hsx.reference``, the suite's
     independent reference) and written in speculators' layout here, not by
     ``hsx export``: an alignment error of hsx's shows as a gap to (a);
   - ``shifted``: (d) the export with every sample's hidden states moved one
     position later (position t holds t-1's): the metric must see a data error;
   - ``online``: (b) ``hsx train-draft`` reading ``hidden_states.ready`` while a
     second ``hsx run`` of the same prompts (greedy: the same answers) extracts,
     on a broker of its own: one pass over the stream, no export, with its
     learning rate on (a)'s schedule (``--steps`` of (a)'s steps). It is set
     beside (a) after one of its four epochs, the same samples and about the
     same steps (the online arm also trains on the 10 % speculators holds out).
   - ``dflash``, ``peagle`` (:data:`TYPE_ARMS`): DFlash and P-EAGLE drafts
     trained as (a) on the same export with ``--speculator-type`` (speculators'
     defaults for the type: DFlash's 16-token blocks, 15 draft tokens a step;
     P-EAGLE's 8), their learning curves measured as (a)'s, and
     ``TYPE_reference`` / ``TYPE_shifted`` as (c) and (d) and ``TYPE_seed1``
     (the export, another seed: the training noise (c) is judged by), set beside
     the type's own checkpoint after as many epochs, and ``TYPE_float32`` as ``float32``;
     vLLM serves each with the method it reads from the checkpoint.

    python -m bench.acceptance [--work DIR] [--only STAGE ...] [--out FILE] [--quick]

Every finished stage's figures are merged into ``bench/results.json`` and
``docs/benchmarks.md`` is rendered again (``python -m bench --only acceptance``
does the same for every stage left). Training runs at about
500 tokens/s on two cores: an arm takes over an hour, so run them one at a time
(``--only offline``); ``WORK`` keeps what each stage made, and a new machine
remakes the data (greedy decoding: the same answers) before training an arm.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, NoReturn

from bench.sink_scale import publish
from bench.speculators_run import read_metrics, validation

ROOT = Path(__file__).resolve().parent.parent
MODEL = "smollm2-135m-instruct"
SPECULATORS_PY = ROOT / ".venv-speculators" / "bin" / "python"


@dataclass(frozen=True)
class Scale:
    train_prompts: int = 2400
    eval_prompts: int = 120
    max_tokens: int = 128
    """Of every regenerated answer, and of every answer in the evaluation."""
    epochs: int = 4
    curve: tuple[int, ...] = (1, 2, 4)
    """The offline arm's checkpoints measured: 25, 50 and 100 % of its training tokens."""


FULL = Scale()
QUICK = Scale(train_prompts=48, eval_prompts=8, max_tokens=32, epochs=2, curve=(1, 2))
"""``--quick``: every stage and arm in minutes, a check of the benchmark itself
(its figures say nothing about drafts)."""
TRAIN_FLAGS = {
    "--draft-vocab-size": "8192",  # 49,152 in SmolLM2's vocabulary; 8,192 cover nearly every answer token
    "--total-seq-len": "2048",
    "--seed": "0",
    "--num-workers": "1",
    "--log-freq": "10",
}
"""What every arm's training is given beyond the command ``hsx export`` prints
(speculators' defaults otherwise: its learning rate and schedule, 10 % of the
rows held out for its own validation)."""


@dataclass(frozen=True)
class Work:
    """Where every stage keeps what it made, under one folder."""

    root: Path
    scale: Scale = FULL
    epochs: int | None = None
    """Train (c) and (d) for only this many epochs of the schedule's (which still
    spans all of them), set beside (a)'s checkpoint after as many: ``--epochs``."""

    @property
    def corpus(self) -> Path:
        return self.root / "corpus"

    @property
    def dataset(self) -> Path:
        return self.root / "dataset"

    def export(self, arm: str = "offline") -> Path:
        return self.root / ("export" if arm == "offline" else f"export-{arm}")

    @property
    def online_dataset(self) -> Path:
        return self.root / "dataset-online"

    def draft(self, arm: str) -> Path:
        return self.root / "drafts" / arm

    def log(self, stage: str) -> Path:
        return self.root / "logs" / f"{stage}.log"

    def figures(self, stage: str) -> Path:
        return self.root / "figures" / f"{stage}.json"


def generate(work: Work) -> str:
    """``hsx run --generate``'s value."""
    return f"max_tokens={work.scale.max_tokens}"


def model_dir() -> Path:
    from hsx import models

    return models.prepare(names=[MODEL])[MODEL]


def hsx_bin() -> str:
    return str(Path(sys.executable).with_name("hsx"))


def speculators_python() -> str:
    if not SPECULATORS_PY.exists():
        sys.exit(f"error: {SPECULATORS_PY} is missing: run `make speculators`")
    return str(SPECULATORS_PY)


def run_logged(argv: list[str], log: Path, env: dict[str, str] | None = None) -> float:
    """Run ``argv`` with its output appended to ``log``; its wall time in s.
    A failure stops the benchmark, naming the log."""
    return Spawned(argv, log, env).wait()


def _failed(argv: list[str], code: int, log: Path) -> NoReturn:
    tail = "\n".join(log.read_text(errors="replace").splitlines()[-20:])
    sys.exit(f"error: exit code {code} from {argv[0]} ...; the end of {log}:\n{tail}")


# -- stages ---------------------------------------------------------------------------------------


def corpus(work: Work) -> dict[str, Any]:
    from bench.acceptance_corpus import build

    started = time.monotonic()
    summary = build(work.corpus, train_size=work.scale.train_prompts, eval_size=work.scale.eval_prompts)
    return {"acceptance_corpus_s": round(time.monotonic() - started, 1),
            "acceptance_train_prompts": summary["train"]["rows"], "acceptance_eval_prompts": summary["eval"]["rows"],
            "acceptance_train_sources": summary["train"]["sources_used"],
            "acceptance_train_sha256": summary["train"]["sha256"], "acceptance_eval_sha256": summary["eval"]["sha256"]}


def data(work: Work) -> dict[str, Any]:
    seconds = run_logged([hsx_bin(), "run", str(work.corpus / "train.jsonl"), "--model", str(model_dir()),
                          "--output", str(work.dataset), "--generate", generate(work)], work.log("data"))
    return {"acceptance_data_s": seconds, "acceptance_generate": generate(work)}


def export(work: Work) -> dict[str, Any]:
    shutil.rmtree(work.export(), ignore_errors=True)  # a half-written export from a stopped run
    seconds = run_logged([hsx_bin(), "export", str(work.export()), "--dataset", str(work.dataset),
                          "--format", "speculators", "--verifier", str(model_dir())], work.log("export"))
    meta = json.loads((work.export() / "hsx_export.json").read_text())
    printed = [line for line in work.log("export").read_text().splitlines() if line.startswith("train with: ")]
    return {"acceptance_export_s": seconds, "acceptance_samples": meta["rows"],
            "acceptance_supervised_tokens": meta["supervised_tokens"], "acceptance_layer_ids": meta["layer_ids"],
            "acceptance_printed_command": printed[-1].removeprefix("train with: ")}


def arm_flags(work: Work, arm: str, data: str | None = None) -> dict[str, list[str]]:
    """The flags of the command ``hsx export`` printed, :data:`TRAIN_FLAGS` over
    them, on the export of arm ``data`` (default: the arm's own) and into the
    arm's draft folder; a draft type's arm (:data:`TYPE_ARMS`) trains that type."""
    printed = json.loads(work.figures("export").read_text())["acceptance_printed_command"].split()
    assert printed[:2] == ["speculators", "train"], printed
    flags: dict[str, list[str]] = {}
    for word in printed[2:]:
        if word.startswith("--"):
            flags[word] = []
        else:
            flags[next(reversed(flags))].append(word)
    flags.update({flag: [value] for flag, value in TRAIN_FLAGS.items()})
    flags["--epochs"] = [str(work.scale.epochs)]
    flags["--data-path"] = [str(work.export(data or arm))]
    flags["--save-path"] = [str(work.draft(arm))]
    if arm in TYPE_ARMS:
        flags["--speculator-type"] = [TYPE_ARMS[arm].kind]
        flags["--seed"] = [str(TYPE_ARMS[arm].seed)]
    return flags


def train_flags(work: Work, arm: str, data: str | None = None) -> list[str]:
    """:func:`arm_flags` as a command line."""
    return [item for flag, values in arm_flags(work, arm, data).items() for item in (flag, *values)]


def evaluate(work: Work, name: str, draft: Path, key: str | None = None,
             flags: tuple[str, ...] = ()) -> dict[str, Any]:
    """``hsx eval-draft`` on the evaluation set (with ``flags``), kept as
    ``eval/NAME.json``: the figures under ``acceptance_KEY_`` (default NAME)."""
    report = work.root / "eval" / f"{name}.json"
    if not report.exists():  # an evaluation done before a stop is kept
        report.parent.mkdir(parents=True, exist_ok=True)
        partial = report.with_suffix(".partial.json")
        seconds = run_logged([hsx_bin(), "eval-draft", str(work.corpus / "eval.jsonl"), "--model", str(model_dir()),
                              "--draft", str(draft), "--max-tokens", str(work.scale.max_tokens), "--json", str(partial),
                              *flags],
                             work.log(f"eval-{name}"))
        result = json.loads(partial.read_text())
        result["eval_s"] = seconds
        report.write_text(json.dumps(result, indent=2))
        partial.unlink()
    result = json.loads(report.read_text())
    keys = ("acceptance_length", "per_position", "num_speculative_tokens", "drafts", "draft_tokens",
            "accepted_tokens", "outputs_identical",
            "differing_prompts", "tokens_per_s_with_draft", "tokens_per_s_without_draft", "prompts", "eval_s")
    return {f"acceptance_{key or name}_{figure}": result[figure] for figure in keys if figure in result}


def untrained_draft(work: Work) -> Path:
    """speculators' ``--dry-run`` draft of the export: initialized, never trained."""
    draft = work.draft("untrained")
    if not (draft / "config.json").exists():
        run_logged([str(Path(speculators_python()).with_name("speculators")), "train",
                    *train_flags(work, "untrained", data="offline"), "--dry-run"], work.log("untrained"))
    return draft


def untrained(work: Work) -> dict[str, Any]:
    return evaluate(work, "untrained", untrained_draft(work))


def train_arm(work: Work, arm: str, epochs: int | None = None, data: str | None = None) -> dict[str, Any]:
    """Train on the export of arm ``data`` (default the arm's own) for ``epochs``
    of the schedule's epochs (default all; resuming speculators' last
    checkpoint) and measure that epoch's checkpoint.

    An epoch is done once speculators has validated it: its validation is in
    the arm's metrics file (:mod:`bench.speculators_run`), or, for runs from
    before that file, in the ``val_metrics.json`` speculators writes where the
    epoch's loss was its best so far."""
    epochs = epochs or work.scale.epochs
    draft = work.draft(arm)
    checkpoint = draft / str(epochs - 1)
    metrics = draft / "hsx_metrics.jsonl"
    timing = draft / "hsx_train_s.json"
    trained = json.loads(timing.read_text())["train_s"] if timing.exists() else 0.0

    def validated() -> dict[str, float] | None:
        saved = checkpoint / "val_metrics.json"
        return validation(read_metrics(metrics), epochs - 1) or (json.loads(saved.read_text()) if saved.exists() else None)

    if validated() is None:
        draft.mkdir(parents=True, exist_ok=True)
        training = Spawned([speculators_python(), "-m", "bench.speculators_run", "--metrics", str(metrics), "--",
                            *train_flags(work, arm, data)], work.log(f"train-{arm}"))
        while training.running() and validated() is None:
            time.sleep(5)
        if training.running():
            training.stop()  # the epochs asked for are done; the schedule spanned them all
        trained += training.wait()
        timing.write_text(json.dumps({"train_s": round(trained, 1)}))  # a stop before the evaluations keeps it
    val = validated()
    if val is None:
        sys.exit(f"[acceptance] {arm}: training ended without validating epoch {epochs} (its log: "
                 f"{work.log(f'train-{arm}')})")
    state = json.loads((checkpoint / "training_state.json").read_text())
    figures: dict[str, Any] = {f"acceptance_{arm}_epochs": epochs, f"acceptance_{arm}_steps": state["global_step"],
                               f"acceptance_{arm}_train_s": trained,
                               f"acceptance_{arm}_val_full_acc": validation_accuracy(val)}  # its held-out 10 %
    name = arm if epochs == work.scale.epochs else f"{arm}_epoch{epochs}"
    return {**figures, **evaluate(work, name, checkpoint, key=arm)}


def validation_accuracy(val: dict[str, float]) -> list[float]:
    """speculators' validation accuracy by draft position from its
    ``val_metrics.json``: EAGLE-3's ``full_acc_K_epoch``, the other types'
    ``position_K_acc_epoch``."""
    if "full_acc_0_epoch" in val:
        keys = [key for k in range(3) if (key := f"full_acc_{k}_epoch") in val]
    else:
        keys = sorted((key for key in val if key.startswith("position_") and key.endswith("_acc_epoch")),
                      key=lambda key: int(key.split("_")[1]))
    return [round(val[key], 3) for key in keys]


def offline(work: Work) -> dict[str, Any]:
    return trained_with_curve(work, "offline")


def trained_with_curve(work: Work, arm: str, data: str | None = None) -> dict[str, Any]:
    """:func:`train_arm` for every epoch of the schedule, then its checkpoints
    after each of the scale's ``curve`` epochs measured too: the arm's learning
    curve, and the points (b), and (c) and (d) with ``--epochs``, are set beside."""
    figures = train_arm(work, arm, data=data)
    curve = []
    last = work.scale.epochs
    for epochs in work.scale.curve:
        name = arm if epochs == last else f"{arm}_epoch{epochs}"  # the last is the arm's own
        point = figures if epochs == last else evaluate(work, name, work.draft(arm) / str(epochs - 1))
        figures.update(point)
        curve.append({"tokens_fraction": epochs / last, "acceptance_length": point[f"acceptance_{name}_acceptance_length"],
                      "per_position": point[f"acceptance_{name}_per_position"]})
    return {**figures, f"acceptance_{arm}_curve": curve}


def float32(arm: str) -> Callable[[Work], dict[str, Any]]:
    """The stage measuring arm ``arm``'s draft again with the verifier and draft
    in float32: whether greedy outputs that differ with the draft in bfloat16
    are the verifier's bfloat16 numerics (batch-dependent) rather than the draft."""
    def stage(work: Work) -> dict[str, Any]:
        final = work.draft(arm) / str(work.scale.epochs - 1)
        return evaluate(work, f"{arm}_float32", final, flags=("--dtype", "float32"))
    return stage


def reference_export(work: Work) -> dict[str, Any]:
    """(c)'s data: HF transformers' hidden states in speculators' layout."""
    from bench.acceptance_arms import write_reference_export

    started = time.monotonic()
    if not (work.export("reference") / "hsx_export.json").exists():
        write_reference_export(work.export(), work.export("reference"), model_dir())
    return {"acceptance_reference_hf_s": round(time.monotonic() - started, 1)}


def shifted_export(work: Work) -> dict[str, Any]:
    """(d)'s data: the export shifted one position."""
    from bench.acceptance_arms import write_shifted_export

    if not (work.export("shifted") / "hsx_export.json").exists():
        write_shifted_export(work.export(), work.export("shifted"))
    return {}


def reference(work: Work) -> dict[str, Any]:
    return {**reference_export(work), **train_arm(work, "reference", work.epochs)}


def shifted(work: Work) -> dict[str, Any]:
    return {**shifted_export(work), **train_arm(work, "shifted", work.epochs)}


@dataclass(frozen=True)
class TypeArm:
    """An arm training a draft type beside EAGLE-3 (:mod:`hsx.runtime.draft_types`)
    on the data of arm ``data``: (a)'s export, (c)'s or (d)'s, with ``seed``."""

    kind: str
    data: str
    seed: int = 0

    @property
    def control(self) -> bool:
        """Trained for ``--epochs`` and set beside the type's own arm after as many."""
        return (self.data, self.seed) != ("offline", 0)


TYPES = ("dflash", "peagle")
"""The draft types trained beside EAGLE-3."""
TYPE_ARMS = {
    **{(kind if data == "offline" else f"{kind}_{data}"): TypeArm(kind, data)
       for kind in TYPES for data in ("offline", "reference", "shifted")},
    **{f"{kind}_seed1": TypeArm(kind, "offline", seed=1) for kind in TYPES},
}
"""Each type trained as (a), (c) and (d) are, with ``--speculator-type`` and
speculators' defaults for that type: ``TYPE`` on the export, ``TYPE_reference``
on (c)'s data, ``TYPE_shifted`` on (d)'s; and ``TYPE_seed1``, the export again
with another seed: how far two trainings on the same data land apart."""


def type_arm(arm: str) -> Callable[[Work], dict[str, Any]]:
    """The stage training arm ``arm`` of :data:`TYPE_ARMS`."""
    typed = TYPE_ARMS[arm]

    def stage(work: Work) -> dict[str, Any]:
        if not typed.control:
            return trained_with_curve(work, arm, typed.data)
        if typed.data != "offline":
            {"reference": reference_export, "shifted": shifted_export}[typed.data](work)
        return train_arm(work, arm, work.epochs, typed.data)
    return stage


def online(work: Work) -> dict[str, Any]:
    """(b): 1. a broker of its own and fresh topics; 2. ``hsx run`` of the training
    chats into a dataset of its own; 3. once its first samples are indexed (the
    engine's start on a CPU outlasts ``--exit-when-idle``), ``hsx train-draft``
    from the ready topic; 4. the trainer stops when the stream has been idle for
    two minutes after the run ends; 5. its last checkpoint is evaluated."""
    draft = work.draft("online")
    if not (draft / "done").exists():
        # The stream lived on the stopped run's broker: a stopped online arm starts over.
        shutil.rmtree(draft, ignore_errors=True)
        shutil.rmtree(work.online_dataset, ignore_errors=True)
        (draft / "done").parent.mkdir(parents=True, exist_ok=True)
        (draft / "done").write_text(json.dumps(_train_online(work)))
    figures = json.loads((draft / "done").read_text())
    final = max((p for p in draft.iterdir() if p.name.isdigit()), key=lambda p: int(p.name))
    state = json.loads((final / "training_state.json").read_text())
    return {**figures, "acceptance_online_steps": state.get("global_step"), **evaluate(work, "online", final)}


def _train_online(work: Work) -> dict[str, Any]:
    from hsx.local.broker import EmbeddedBroker
    from hsx.local.topics import fresh_topics
    from hsx.runtime.settings import KafkaSettings

    flags = arm_flags(work, "offline")
    # (a)'s schedule: its learning rate warms up over 1 % of these steps and decays over the rest, so
    # after one pass the online draft stands where (a) stood after one of its epochs.
    steps = json.loads(work.figures("offline").read_text())["acceptance_offline_steps"]
    with EmbeddedBroker() as broker:
        topics = fresh_topics(KafkaSettings(bootstrap=broker.bootstrap), prefix="acceptance.")
        env = {**os.environ, **{f"HSX_TOPIC_{name.upper()}": topic for name, topic in asdict(topics.topics()).items()}}
        started = time.monotonic()
        extraction = Spawned([hsx_bin(), "run", str(work.corpus / "train.jsonl"), "--bootstrap", broker.bootstrap,
                              "--model", str(model_dir()), "--output", str(work.online_dataset),
                              "--generate", generate(work)], work.log("data-online"), env)
        try:
            while extraction.running() and not any((work.online_dataset / "index").glob("*.json")):
                time.sleep(2)
            trainer = Spawned([
                str(Path(speculators_python()).with_name("hsx")), "train-draft", "--bootstrap", broker.bootstrap,
                "--ready-topic", topics.topics().ready, "--group", "acceptance-online", "--dataset",
                str(work.online_dataset), "--model", str(model_dir()), "--save-path", str(work.draft("online")),
                "--steps", str(steps), "--checkpoint-every", "100", "--exit-when-idle", "120",
                *(item for flag in ("--draft-vocab-size", "--total-seq-len", "--hidden-states-dtype", "--seed")
                  for item in (flag, *flags[flag]))], work.log("train-online"), env)
            try:
                data_s = extraction.wait()
                trainer.wait()
            finally:
                trainer.stop()
        finally:
            extraction.stop()
    return {"acceptance_online_data_s": data_s, "acceptance_online_train_s": round(time.monotonic() - started, 1)}


class Spawned:
    """A command running beside others, its output appended to a log; as
    :func:`run_logged`, a failure stops the benchmark, naming the log."""

    def __init__(self, argv: list[str], log: Path, env: dict[str, str] | None = None) -> None:
        log.parent.mkdir(parents=True, exist_ok=True)
        print(f"[acceptance] {' '.join(argv)}  (log: {log})", flush=True)
        self.argv, self.log, self.started, self.stopped = argv, log, time.monotonic(), False
        with log.open("a") as out:
            self.process = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)

    def running(self) -> bool:
        return self.process.poll() is None

    def stop(self) -> None:
        """Ends it if it still runs: its work is done, or another failure stopped the benchmark."""
        if self.running():
            self.stopped = True
            self.process.terminate()
            self.process.wait()

    def wait(self) -> float:
        """Its wall time in s, once it exits 0 (or was stopped)."""
        if self.process.wait() != 0 and not self.stopped:
            _failed(self.argv, self.process.returncode, self.log)
        return round(time.monotonic() - self.started, 1)


STAGES: dict[str, tuple[Callable[[Work], dict[str, Any]], tuple[str, ...]]] = {
    "corpus": (corpus, ()),
    "data": (data, ("corpus",)),
    "export": (export, ("data",)),
    "untrained": (untrained, ("export",)),
    "offline": (offline, ("export",)),
    "float32": (float32("offline"), ("offline",)),
    "reference": (reference, ("export",)),
    "shifted": (shifted, ("export",)),
    "online": (online, ("offline",)),
    **{arm: (type_arm(arm), ("export",)) for arm in TYPE_ARMS},
    **{f"{kind}_float32": (float32(kind), (kind,)) for kind in TYPES},
}
"""Each stage, and the stages it needs done first."""
EPOCH_ARMS = ("reference", "shifted", *(arm for arm, typed in TYPE_ARMS.items() if typed.control))
"""The arms ``--epochs`` may stop early (training again resumes their last checkpoint)."""


def ensure(work: Work, stage: str) -> dict[str, Any]:
    """The stage's figures: from its file where it is done, else run (after
    what it needs) and record them."""
    done = work.figures(stage)
    if done.exists():
        figures = json.loads(done.read_text())
        trained = figures.get(f"acceptance_{stage}_epochs", work.scale.epochs)  # recorded since --epochs exists
        if stage not in EPOCH_ARMS or trained == (work.epochs or work.scale.epochs):
            return figures
    run, needs = STAGES[stage]
    for need in needs:
        ensure(work, need)
    print(f"[acceptance] stage {stage} ...", flush=True)
    figures = run(work)
    done.parent.mkdir(parents=True, exist_ok=True)
    done.write_text(json.dumps(figures, indent=2) + "\n")
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", type=Path, help="where the stages keep what they make "
                        "(default out/acceptance, or out/acceptance-quick with --quick)")
    parser.add_argument("--only", nargs="+", choices=list(STAGES), default=list(STAGES))
    parser.add_argument("--out", type=Path,
                        help="the results file every finished stage's figures are merged into (default "
                             "bench/results.json, whose page docs/benchmarks.md is rendered again; with --quick "
                             "WORK/results.json)")
    parser.add_argument("--epochs", type=int, metavar="N",
                        help="train (c) reference and (d) shifted for only N epochs of their schedule (which "
                             "still spans all of them) and set them beside (a) after N epochs; a later run "
                             "without it trains them on from there")
    parser.add_argument("--quick", action="store_true",
                        help=f"{QUICK.train_prompts} training prompts, {QUICK.eval_prompts} to evaluate, answers of "
                             f"{QUICK.max_tokens} tokens, {QUICK.epochs} epochs: a check of the benchmark (minutes)")
    args = parser.parse_args()
    scale = QUICK if args.quick else FULL
    if args.epochs is not None and not 1 <= args.epochs <= scale.epochs:
        parser.error(f"--epochs {args.epochs}: the schedule has {scale.epochs} epochs")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    work = Work((args.work or ROOT / "out" / ("acceptance-quick" if args.quick else "acceptance")).resolve(),
                scale, args.epochs)
    for stage in args.only:
        ensure(work, stage)
    figures: dict[str, Any] = {}
    for stage in STAGES:
        if work.figures(stage).exists():
            figures.update(json.loads(work.figures(stage).read_text()))
    out = args.out or (work.root / "results.json" if args.quick else ROOT / "bench" / "results.json")
    publish(out, ROOT / "docs" / "benchmarks.md", figures)  # merged: other sections' figures stay
    print(f"[acceptance] {len(figures)} figures merged into {out}", flush=True)

if __name__ == "__main__":
    main()
