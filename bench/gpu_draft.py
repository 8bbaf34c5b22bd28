"""speculators' EAGLE-3 training on a GPU, on rows of a real hsx export: the
throughput the acceptance benchmark's offline arm (``bench.acceptance``) trains
at on an H200 instead of two CPU cores (about 390 tokens/s over the whole run
there, 480 per step by speculators' own count).

The lent GPU host takes at most 64 MiB of files and reaches no network, so
neither the export (2.1 GB of hidden states) nor the verifier's weights (538 MB)
can go there. What goes instead is a *bundle* (``pack``, here):

- the first rows of the export that fit a byte budget, their hidden states in
  hsx's own block codec (``byteplane-zstd``, :mod:`hsx.codecs.block`), with the
  SHA-256 of every original ``hs_<row>.safetensors``;
- the export's vocabulary mappings (``d2t-*.npy``, ``t2d-*.npy``, ``token_freq.pt``);
- a *slim verifier*: the verifier's config and tokenizer files, and of its
  weights only what speculators' Eagle3 model loads (``embed_tokens.weight``,
  ``lm_head.weight`` where it is not tied, ``model.norm.weight``), with every
  vocabulary row zeroed except those training reads: the tokens in the rows'
  ``input_ids``, the draft vocabulary (``t2d``: speculators restricts the LM head
  to it), token 0 (speculators' collate pads with it) and the config's special
  tokens. Zero rows compress to nothing; the rows kept are the real float32
  values, so training on the bundle's rows computes what it would with the
  whole verifier;
- the acceptance benchmark's train flags (``bench.acceptance.arm_flags``).

On the GPU host, ``train`` rebuilds the export (each hidden-state file checked
against its SHA-256) and the slim verifier, repeats the rows R times (hard links
to the same files, renumbered) so that the run trains on about as many tokens as
the whole export holds (about the same number of steps), and runs ``speculators
train`` with those flags and nothing of hsx's CPU adaptations. speculators'
defaults stay (flex attention, compiled) but one: its default fused loss does not
trace under the host's torch 2.11 (dynamo: "ListVariable ... is already tracked
for mutation" on the Triton kernels' shared ``configs``), so the host runs it with
``--loss-implementation eager``. A repeated row is still a real row: the figures
are the trainer's throughput on hsx data of this model, not a draft's quality
(that needs the whole export, see ``bench.acceptance``; the loss on rows seen
104 times says nothing). The steps' figures come from speculators' metrics logger
(:mod:`bench.speculators_run`), the wall time from the clock around the
command. On an H200 most of a run's wall time is compiling (the first step and
the first validation); ``gpu_draft_steady_tokens_per_s`` is the rate between
logged steps within an epoch.

    .venv/bin/python -m bench.gpu_draft pack OUT_DIR [--budget-mb 15]     # here
    python3 -m bench.gpu_draft train BUNDLE --out FILE --loss-implementation eager   # on the GPU host
    .venv/bin/python -m bench.gpu_draft merge FILE [FILE ...]               # here, afterwards

``merge`` adds flat ``gpu_*`` figure files (this one's ``gpu_draft_*``, and
``bench.gpu_check``'s ``gpu_*``) to ``bench/results.json``, with the CPU run's
figures beside the GPU's (:func:`cpu_comparison`), and renders
``docs/benchmarks.md``. The GPU host needs wheels for speculators and what it
brings that the host lacks or has in another version (speculators, hs-connectors,
datasets, dill, multiprocess, loguru, openai, jiter, sniffio, httpx2, httpcore2,
truststore, pydantic-settings, python-dotenv, transformers, fsspec, tqdm), hsx's
own (``pip wheel --no-deps .``) and those ``bench.gpu_check`` names; with hsx
installed from its wheel, run ``python3 -m bench...`` from a folder that holds
``bench`` alone (from the repository root, ``import hsx`` finds ``./hsx``, which
lacks the packages mapped into it). Without an accelerator, ``train`` runs
through :mod:`hsx.trainer.speculators_cpu` (a check of this script at tiny
sizes: ``--repeat 2 --epochs 1``).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from importlib.metadata import version
from pathlib import Path
from typing import Any

import numpy as np
import torch

from bench.speculators_run import read_metrics
from hsx.codecs.block import decode_block, encode_block
from hsx.runtime.tensors import TORCH_DTYPES

ROOT = Path(__file__).resolve().parent.parent
MANIFEST = "manifest.json"
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".index.json")
VERIFIER_WEIGHTS = ("embed_tokens.weight", "lm_head.weight", "model.norm.weight")
"""What speculators' Eagle3 model loads from the verifier (``load_verifier_weights``)."""
VOCAB_ROWS = ("embed_tokens.weight", "lm_head.weight")
PLACEHOLDERS = {"--data-path": "{data}", "--verifier-name-or-path": "{verifier}", "--save-path": "{save}"}
TRAIN_RATIO = 0.9
"""speculators' default ``--train-data-ratio``: the first 90 % of the rows train."""


# -- here: the bundle --------------------------------------------------------------------------


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def encode_tensor(tensor: torch.Tensor) -> bytes:
    """A tensor as one hsx block record (rows × 1 × columns; a vector is one row)."""
    matrix = tensor.reshape(1, -1) if tensor.dim() == 1 else tensor.reshape(tensor.shape[0], 1, -1)
    dtype = next(d for d, t in TORCH_DTYPES.items() if t == tensor.dtype)
    raw = matrix.contiguous().view(torch.uint8).numpy()
    return encode_block(raw, shape=(matrix.shape[0], 1, matrix.shape[-1]), dtype=dtype, token_start=0)


def decode_tensor(record: bytes, shape: list[int]) -> torch.Tensor:
    """:func:`encode_tensor`'s inverse (the block's checksum verified)."""
    header, raw = decode_block(record)
    return torch.frombuffer(bytearray(raw), dtype=TORCH_DTYPES[header.dtype]).reshape(shape)


def needed_rows(input_ids: Iterator[torch.Tensor], t2d: np.ndarray, config: dict[str, Any]) -> torch.Tensor:
    """The vocabulary rows training reads (the module docstring says which), sorted."""
    keep = {0, *np.flatnonzero(t2d).tolist()}
    for name in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id"):
        value = config.get(name)
        keep.update(value if isinstance(value, list) else [] if value is None else [value])
    for ids in input_ids:
        keep.update(ids.unique().tolist())
    return torch.tensor(sorted(keep), dtype=torch.long)


def slim_weights(verifier: Path, rows: torch.Tensor) -> dict[str, torch.Tensor]:
    """The verifier's tensors that speculators loads, vocabulary rows outside
    ``rows`` zeroed; found by name suffix in every safetensors file, as
    speculators finds them."""
    from safetensors import safe_open

    out: dict[str, torch.Tensor] = {}
    for path in sorted(verifier.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 (safe_open is no mapping)
                if key.endswith(VERIFIER_WEIGHTS):
                    tensor = f.get_tensor(key)
                    if key.endswith(VOCAB_ROWS):
                        slim = torch.zeros_like(tensor)
                        slim[rows] = tensor[rows]
                        tensor = slim
                    out[key] = tensor
    if not any(key.endswith("embed_tokens.weight") for key in out):
        raise ValueError(f"{verifier}: no embed_tokens.weight in its safetensors files")
    return out


def pack(export: Path, verifier: Path, out: Path, flags: dict[str, list[str]],
         budget_bytes: int = 15_000_000) -> dict[str, Any]:
    """Write the bundle (the module docstring says what it holds) to ``out``;
    returns its manifest. ``flags`` are the training flags in
    ``bench.acceptance.arm_flags``' form."""
    from datasets import load_from_disk
    from safetensors.torch import load_file, save

    rows = load_from_disk(str(export))
    (out / "hidden_states").mkdir(parents=True)
    hidden: list[dict[str, Any]] = []
    packed = 0
    for row in range(len(rows)):
        path = export / "hidden_states" / f"hs_{row}.safetensors"
        tensors = load_file(str(path))
        if not torch.equal(tensors["token_ids"], rows[row]["input_ids"].long()):
            raise ValueError(f"{path}: token_ids differ from the row's input_ids")  # they are rebuilt from them
        record = encode_tensor(tensors["hidden_states"])
        if hidden and packed + len(record) > budget_bytes:
            break
        (out / "hidden_states" / f"hs_{row}.hsxb").write_bytes(record)
        hidden.append({"shape": list(tensors["hidden_states"].shape), "sha256": sha256(path.read_bytes())})
        packed += len(record)
    subset = rows.select(range(len(hidden)))
    subset.save_to_disk(str(out / "data"))
    for path in [*export.glob("*.npy"), export / "token_freq.pt"]:
        if path.exists():
            shutil.copy2(path, out / path.name)

    draft_vocab = flags["--draft-vocab-size"][0]
    config = json.loads((verifier / "config.json").read_text())
    keep = needed_rows((subset[i]["input_ids"] for i in range(len(subset))), np.load(export / f"t2d-{draft_vocab}.npy"),
                       config)
    weights = slim_weights(verifier, keep)
    (out / "verifier").mkdir()
    for path in verifier.iterdir():
        if path.is_file() and not path.name.endswith(WEIGHT_SUFFIXES):
            shutil.copy2(path, out / "verifier" / path.name)
    tensors = []
    for i, (key, tensor) in enumerate(weights.items()):
        (out / "verifier" / f"tensor_{i}.hsxb").write_bytes(encode_tensor(tensor))
        tensors.append({"key": key, "shape": list(tensor.shape)})

    seq_len = seq_lens(export)
    manifest = {
        "export": str(export), "export_rows": len(rows), "rows": len(hidden), "hidden_states": hidden,
        "hidden_states_bytes": packed, "repeat": max(1, round(sum(seq_len) / sum(seq_len[: len(hidden)]))),
        "verifier": {"source": str(verifier), "tensors": tensors, "rows_kept": len(keep),
                     "vocab_rows": int(config["vocab_size"]), "sha256": sha256(save(weights))},
        "flags": {flag: [PLACEHOLDERS.get(flag, value) for value in values] for flag, values in flags.items()},
    }
    (out / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


# -- on the GPU host: rebuild, repeat, train -----------------------------------------------------


def unpack(bundle: Path, work: Path, repeat: int) -> tuple[Path, Path]:
    """The export (rows repeated ``repeat`` times) and the slim verifier under
    ``work``; raises ``ValueError`` if a rebuilt file differs from its original."""
    from datasets import concatenate_datasets, load_from_disk
    from safetensors.torch import save

    manifest = json.loads((bundle / MANIFEST).read_text())
    export, verifier = work / "export", work / "verifier"
    subset = load_from_disk(str(bundle / "data"))
    repeated = concatenate_datasets([subset] * repeat)
    repeated.set_format(type="torch")  # as hsx export writes it
    repeated.save_to_disk(str(export))
    (export / "hidden_states").mkdir()
    n = manifest["rows"]
    for row, meta in enumerate(manifest["hidden_states"]):
        record = (bundle / "hidden_states" / f"hs_{row}.hsxb").read_bytes()
        hidden = decode_tensor(record, meta["shape"])
        data = save({"hidden_states": hidden, "token_ids": subset[row]["input_ids"].long()})
        if sha256(data) != meta["sha256"]:
            raise ValueError(f"hs_{row}.safetensors rebuilt from the bundle differs from the export's")
        first = export / "hidden_states" / f"hs_{row}.safetensors"
        first.write_bytes(data)
        for copy in range(1, repeat):
            os.link(first, export / "hidden_states" / f"hs_{copy * n + row}.safetensors")
    for path in [*bundle.glob("*.npy"), bundle / "token_freq.pt"]:
        if path.exists():
            shutil.copy2(path, export / path.name)

    shutil.copytree(bundle / "verifier", verifier, ignore=shutil.ignore_patterns("tensor_*.hsxb"))
    weights = {t["key"]: decode_tensor((bundle / "verifier" / f"tensor_{i}.hsxb").read_bytes(), t["shape"])
               for i, t in enumerate(manifest["verifier"]["tensors"])}
    data = save(weights)
    if sha256(data) != manifest["verifier"]["sha256"]:
        raise ValueError("the slim verifier rebuilt from the bundle differs from the one packed")
    (verifier / "model.safetensors").write_bytes(data)
    return export, verifier


def run_timed(argv: list[str], timeout: float, env: dict[str, str]) -> tuple[float, bool]:
    """Run ``argv`` (output to ours) in a session of its own; its wall time and
    whether it finished in ``timeout`` s (it and its DataLoader workers are
    killed otherwise). A failure raises."""
    started = time.monotonic()
    proc = subprocess.Popen(argv, env=env, start_new_session=True)
    try:
        code = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        return round(time.monotonic() - started, 1), False
    if code != 0:
        raise RuntimeError(f"speculators train exited with {code}")
    return round(time.monotonic() - started, 1), True


def summarize(records: list[dict[str, Any]], tokens_per_step: float | None) -> dict[str, Any]:
    """Figures from speculators' metric records: loss, its own per-step
    tokens/s, and a steady rate from the times of the logged steps within an
    epoch (the first logged step, which compiles, and epoch ends with their
    validation and checkpoint left out). ``tokens_per_step``: an epoch's tokens
    ÷ its steps where the run finished; else the logged steps' mean."""
    train = [r for r in records if "train" in r]
    val = [r["val"] for r in records if "val" in r]
    peak = next((r for r in records if "peak_allocated" in r), None)
    out: dict[str, Any] = {}
    if train:
        out.update(loss_first=round(train[0]["train"]["loss"], 3), loss_last=round(train[-1]["train"]["loss"], 3),
                   logged_steps=len(train), last_logged_step=train[-1]["global_step"])
        later = [r["profile"] for r in train[1:] if r.get("profile")]
        if later:
            out["profile_tokens_per_s_median"] = round(statistics.median(p["tokens_per_s"] for p in later), 1)
            out["profile_step_ms_median"] = round(statistics.median(p["step_ms"] for p in later), 2)
            tokens_per_step = tokens_per_step or statistics.mean(p["tokens_per_s"] * p["step_ms"] / 1000 for p in later)
        steps = seconds = 0.0
        for a, b in zip(train[1:], train[2:]):
            if a["epoch"] == b["epoch"]:
                steps += b["global_step"] - a["global_step"]
                seconds += b["t"] - a["t"]
        if seconds and tokens_per_step:
            out["steady_steps_per_s"] = round(steps / seconds, 2)
            out["steady_tokens_per_s"] = round(steps * tokens_per_step / seconds, 1)
    if val:
        out["val_loss"] = round(val[-1]["loss_epoch"], 3)
        out["val_full_acc"] = [round(val[-1][f"full_acc_{k}_epoch"], 3) for k in range(8)
                               if f"full_acc_{k}_epoch" in val[-1]]
    if peak:
        out["peak_memory_gib"] = round(peak["peak_allocated"] / 2**30, 2)
        out["peak_reserved_gib"] = round(peak["peak_reserved"] / 2**30, 2)
    return out


def train(bundle: Path, out: Path, work: Path, repeat: int | None = None, epochs: int | None = None,
          timeout: float = 300.0, loss_implementation: str | None = None) -> dict[str, Any]:
    """Rebuild the bundle under ``work``, train on it, and write the
    ``gpu_draft_*`` figures to ``out``; returns them. ``loss_implementation``:
    speculators' ``--loss-implementation``, where its default cannot run."""
    manifest = json.loads((bundle / MANIFEST).read_text())
    repeat = repeat or manifest["repeat"]
    shutil.rmtree(work, ignore_errors=True)
    started = time.monotonic()
    export, verifier = unpack(bundle, work, repeat)
    unpack_s = round(time.monotonic() - started, 1)
    flags = dict(manifest["flags"])
    if epochs:
        flags["--epochs"] = [str(epochs)]
    if loss_implementation:
        flags["--loss-implementation"] = [loss_implementation]
    epochs = int(flags["--epochs"][0])
    places = {"{data}": str(export), "{verifier}": str(verifier), "{save}": str(work / "draft")}
    argv = [item for flag, values in flags.items() for item in (flag, *(places.get(v, v) for v in values))]
    metrics = work / "metrics.jsonl"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "COLUMNS": "160"}
    print("[gpu_draft] speculators train " + " ".join(argv), flush=True)
    train_s, completed = run_timed([sys.executable, "-m", "bench.speculators_run", "--metrics", str(metrics),
                                    "--", *argv], timeout, env)

    seq_len = seq_lens(export)
    train_rows = int(len(seq_len) * TRAIN_RATIO)
    tokens_per_epoch = sum(seq_len[:train_rows])
    records = read_metrics(metrics)
    state = work / "draft" / str(epochs - 1) / "training_state.json"
    steps = json.loads(state.read_text())["global_step"] if completed and state.exists() else None
    summary = summarize(records, tokens_per_epoch * epochs / steps if steps else None)
    figures: dict[str, Any] = {
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "torch": torch.__version__, "speculators": version("speculators"), "transformers": version("transformers"),
        "rows_packed": manifest["rows"], "repeat": repeat, "rows": len(seq_len), "train_rows": train_rows,
        "export_rows": manifest["export_rows"],
        "bundle_hidden_states_mb": round(manifest["hidden_states_bytes"] / 1e6, 1),
        "verifier_rows_kept": manifest["verifier"]["rows_kept"], "verifier_rows": manifest["verifier"]["vocab_rows"],
        "rebuilt_bit_exact": True, "unpack_s": unpack_s, "epochs": epochs, "tokens_per_epoch": tokens_per_epoch,
        "loss_implementation": loss_implementation or "default", "completed": completed, "train_s": train_s,
        "timeout_s": timeout, "steps": steps, "command": "speculators train " + " ".join(argv), **summary,
    }
    if completed:
        figures["tokens_per_s"] = round(tokens_per_epoch * epochs / train_s, 1)
    figures = {f"gpu_draft_{key}": value for key, value in figures.items()}
    out.write_text(json.dumps(figures, indent=2) + "\n")
    return figures


def seq_lens(export: Path) -> list[int]:
    """An export's ``seq_len`` column, in row order."""
    from datasets import load_from_disk

    return list(load_from_disk(str(export)).with_format(None)["seq_len"])


# -- here, afterwards ------------------------------------------------------------------------------


def cpu_comparison(figures: dict[str, Any], results: dict[str, Any]) -> dict[str, Any]:
    """The acceptance benchmark's offline arm (the same training on the whole
    export, two CPU cores) beside ``figures``: tokens/s over its whole run,
    counted as ``gpu_draft_tokens_per_s`` is (the train split's tokens × epochs
    ÷ wall time), and speculators' own per-step median from its log."""
    from bench import acceptance

    work = acceptance.Work(ROOT / "out" / "acceptance")
    train_s = results.get("acceptance_offline_train_s")
    if not train_s or not work.export().exists():
        return {}
    seq_len = seq_lens(work.export())
    tokens = sum(seq_len[: int(len(seq_len) * TRAIN_RATIO)]) * int(acceptance.arm_flags(work, "offline")["--epochs"][0])
    out: dict[str, Any] = {"cpu_train_s": train_s, "cpu_steps": results.get("acceptance_offline_steps"),
                           "cpu_tokens_per_s": round(tokens / train_s, 1)}
    log = work.log("train-offline")
    text = log.read_text() if log.exists() else ""
    per_step = [float(v) for v in re.findall(r"profile/tokens_per_s=([0-9.e+-]+)", text)]
    if len(per_step) > 1:  # the first step's is left out, as on the GPU
        out["cpu_profile_tokens_per_s_median"] = round(statistics.median(per_step[1:]), 1)
    if figures.get("gpu_draft_tokens_per_s"):
        out["speedup_vs_cpu"] = round(figures["gpu_draft_tokens_per_s"] / out["cpu_tokens_per_s"], 1)
    if figures.get("gpu_draft_profile_tokens_per_s_median") and "cpu_profile_tokens_per_s_median" in out:
        out["step_speedup_vs_cpu"] = round(figures["gpu_draft_profile_tokens_per_s_median"]
                                           / out["cpu_profile_tokens_per_s_median"], 1)
    return {f"gpu_draft_{key}": value for key, value in out.items()}


def merge(files: list[Path], results: Path, doc: Path) -> dict[str, Any]:
    """Flat ``gpu_*`` figure files merged into ``results`` (re-read just before
    writing: other sections write there too), with :func:`cpu_comparison` where
    they hold ``gpu_draft_*`` figures, and ``doc`` rendered again."""
    from bench.sink_scale import publish

    figures: dict[str, Any] = {}
    for path in files:
        loaded = json.loads(path.read_text())
        if not all(key.startswith("gpu_") for key in loaded):
            raise ValueError(f"{path}: every key must start with gpu_")
        figures.update(loaded)
    if "gpu_draft_train_s" in figures:
        figures.update(cpu_comparison(figures, json.loads(results.read_text()) if results.exists() else {}))
    return publish(results, doc, figures)


def acceptance_inputs() -> tuple[Path, Path, dict[str, list[str]]]:
    """The acceptance benchmark's export, the verifier its offline arm trained
    with, and that arm's flags."""
    from bench import acceptance

    work = acceptance.Work(ROOT / "out" / "acceptance")
    flags = acceptance.arm_flags(work, "offline")
    return work.export(), Path(flags["--verifier-name-or-path"][0]), flags


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("pack", help="the bundle from the acceptance benchmark's export (here)")
    p.add_argument("out", type=Path)
    p.add_argument("--budget-mb", type=float, default=15.0, help="compressed hidden states, MB (default 15)")
    t = sub.add_parser("train", help="rebuild, repeat and train (on the GPU host)")
    t.add_argument("bundle", type=Path)
    t.add_argument("--out", type=Path, required=True, help="the gpu_draft_* figures, JSON")
    t.add_argument("--work", type=Path, default=Path("/tmp/gpu-draft"))
    t.add_argument("--repeat", type=int, help="copies of the rows (default: as many tokens as the whole export)")
    t.add_argument("--epochs", type=int, help="instead of the acceptance benchmark's")
    t.add_argument("--timeout", type=float, default=300.0, help="stop training after this many s (figures kept)")
    t.add_argument("--loss-implementation", help="speculators' flag, where its default (fused) cannot run")
    m = sub.add_parser("merge", help="gpu_* figure files into bench/results.json and the page (here)")
    m.add_argument("files", type=Path, nargs="+")
    m.add_argument("--results", type=Path, default=ROOT / "bench" / "results.json")
    m.add_argument("--doc", type=Path, default=ROOT / "docs" / "benchmarks.md")
    args = parser.parse_args()
    if args.command == "pack":
        export, verifier, flags = acceptance_inputs()
        manifest = pack(export, verifier, args.out, flags, int(args.budget_mb * 1e6))
        print(f"[gpu_draft] {manifest['rows']} rows, {manifest['hidden_states_bytes'] / 1e6:.1f} MB of hidden "
              f"states, repeat {manifest['repeat']}, verifier rows kept {manifest['verifier']['rows_kept']}")
    elif args.command == "train":
        print(json.dumps(train(args.bundle, args.out, args.work, args.repeat, args.epochs, args.timeout,
                               args.loss_implementation), indent=2))
    else:
        merge(args.files, args.results, args.doc)


if __name__ == "__main__":
    main()
