"""Hostile invocations of every ``hsx`` command: each fails with one line that
names the flag, the value and the rule, and the exit code of the README's table,
without a traceback. Rows whose arguments are wrong locally must fail before
any network or engine: no broker runs, ``--bootstrap`` points at a closed port,
and neither a Kafka wait nor a vLLM line may appear.

The table runs in-process through :func:`hsx.cli.main` (cheap); the five
invocations of issue 17 also run as ``python -m hsx.cli`` from a plain shell."""

from __future__ import annotations

import contextlib
import os
import re
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from hsx import models
from hsx.cli import main
from hsx.runtime.errors import ExitCode
from hsx.schemas.connector import ConnectorConfig
from tests.mounts import tmpfs
from tests.unit.input_files import text_rows, write_hf_dataset, write_jsonl
from tests.unit.test_draft_checkpoint import write_draft

pytestmark = pytest.mark.integration

BAD = ["--bootstrap", "127.0.0.1:1"]
"""A closed port: a command that contacts Kafka before failing would wait there."""
USAGE, UNAVAILABLE = ExitCode.USAGE, ExitCode.UNAVAILABLE
LOCAL_SECONDS = 20.0
"""Bound for a local rejection (in-process; the first rows pay for imports)."""
BLOCK_BYTES_MIN = ConnectorConfig.model_fields["block_bytes"].metadata[0].ge
ERROR_LINE = re.compile(r"\bhsx( [a-z-]+)?: ")
"""The command's error line: ``hsx sink: ...`` (logged) or argparse's ``hsx sink: argument ...``."""
ENGINE_OR_WAIT = re.compile(r"vllm|Initializing|waiting for the Kafka cluster", re.IGNORECASE)

def _row_id(value: object) -> str | None:
    return " ".join(value) if isinstance(value, list) else None


# (argv, exit code, phrase of the error line). Placeholders: {tiny} the tiny model, {vlm} tiny-qwen2.5-vl,
# {prompts} a JSONL file, {tmp} this test's directory (exists), {config_only} and
# {empty} model directories lacking weights / config.json, {dataset} a dataset
# without samples, {hf} a datasets.save_to_disk input, {busy} a port in use, {draft}
# a folder of draft checkpoints (good, and three kinds of wrong).
LOCAL = [
    (["broker", "--port", "70000"], USAGE, "argument --port: must be at most 65535, got 70000"),
    (["broker", "--port", "{busy}"], USAGE, "--port {busy} on --host 127.0.0.1: cannot listen there"),
    (["broker", "--host", "203.0.113.7"], USAGE, "--host 203.0.113.7: cannot listen there"),
    (["produce", "/nonexistent.jsonl", *BAD, "--no-progress"], USAGE,
     "hsx produce: cannot read /nonexistent.jsonl: No such file or directory"),
    (["produce", "{tmp}/rows.csv", *BAD], USAGE, "unknown extension '.csv'"),
    (["produce", "{prompts}", "--seed", "3", *BAD], USAGE, "--seed only makes sense with --shuffle"),
    (["produce", "{prompts}", "--limit", "-1", *BAD], USAGE, "argument --limit: must be at least 0, got -1"),
    (["produce", "{prompts}", "--connect-timeout", "-5", *BAD], USAGE,
     "argument --connect-timeout: must be at least 0, got -5"),
    (["produce", "{prompts}", "--input-format", "csv", *BAD], USAGE,
     "argument --input-format: must be one of jsonl, json, parquet, arrow, hf-disk; got 'csv'"),
    (["extract", "--model", "/nonexistent", *BAD], USAGE, "--model /nonexistent: no such directory"),
    (["extract", "--model", "{config_only}", *BAD], USAGE, "no weights in it (*.safetensors or *.bin)"),
    (["extract", "--model", "{empty}", *BAD], USAGE, "--model {empty}: no config.json in it"),
    (["extract", "--model", "{prompts}", *BAD], USAGE, "--model {prompts}: not a directory"),
    # vLLM's vision-language models import torchvision, which make install removes on CPU
    # (no build of it loads beside the CPU torch): one line, not vLLM's traceback.
    (["extract", "--model", "{vlm}", *BAD], USAGE,
     "--model {vlm}: Qwen2_5_VLForConditionalGeneration is a vision-language model: the engine needs torchvision "
     "to load one, and it does not import here (ModuleNotFoundError: No module named 'torchvision')"),
    (["extract", "--model", "{tiny}", "--layers", "1,99", *BAD], USAGE,
     "hsx extract: layer ids go up to num_hidden_layers = 4, got [1, 99]"),
    (["extract", "--model", "{tiny}", "--layers", "2,x", *BAD], USAGE, "--layers wants comma-separated integers"),
    (["extract", "--model", "{tiny}", "--max-inflight", "-1", *BAD], USAGE,
     "argument --max-inflight: must be at least 1, got -1"),
    (["extract", "--model", "{tiny}", "--max-model-len", "1", *BAD], USAGE,
     "argument --max-model-len: must be at least 2, got 1"),
    (["extract", "--model", "{tiny}", "--max-model-len", "4096", *BAD], USAGE,
     "hsx extract: --max-model-len 4096 is more than the model's context of 2048 tokens"),
    (["extract", "--model", "{tiny}", "--block-bytes", "100", *BAD], USAGE,
     f"argument --block-bytes: must be at least {BLOCK_BYTES_MIN}, got 100"),
    (["extract", "--model", "{tiny}", "--codec", "lz4", *BAD], USAGE,
     "argument --codec: must be one of byteplane-zstd, zstd, none; got 'lz4'"),
    (["extract", "--model", "{tiny}", "--codec-level", "99", *BAD], USAGE,
     "argument --codec-level: must be at most 22, got 99"),
    (["extract", "--model", "{tiny}", "--dtype", "int3", *BAD], USAGE, "argument --dtype: invalid choice: 'int3'"),
    (["extract", "--model", "{tiny}", "--stats-file", "/nonexistent/stats.json", *BAD], USAGE,
     "--stats-file /nonexistent/stats.json: no directory /nonexistent"),
    (["extract", *BAD], USAGE, "the following arguments are required: --model"),
    (["extract", "--model", "{tiny}", "--pipeline-parallel-size", "2", *BAD], USAGE,
     "hsx extract: --pipeline-parallel-size 2: hidden-state extraction does not support pipeline parallelism"),
    (["sink", "--output", "/proc/x", *BAD], USAGE, "--output /proc/x: /proc is on a virtual filesystem"),
    (["sink", "--output", "{prompts}/x", *BAD], USAGE, "{prompts} is a file, not a directory"),
    (["sink", "--output", "{prompts}", *BAD], USAGE, "--output {prompts}: exists and is not a directory"),
    (["sink", "--output", "{tmp}/out", "--max-shard-samples", "0", *BAD], USAGE,
     "argument --max-shard-samples: must be at least 1, got 0"),
    (["sink", "--output", "{tmp}/out", "--max-shard-age", "0", *BAD], USAGE,
     "argument --max-shard-age: must be more than 0, got 0"),
    (["sink", "--output", "s3://", *BAD], USAGE, "hsx sink: s3://: an object-store dataset is s3://BUCKET[/PREFIX]"),
    (["sink", "--output", "gs://bucket/x", *BAD], USAGE, "dataset gs://bucket/x: gs:// is not supported"),
    (["sink", "--output", "s3://bucket/x", "--upload-part-bytes", "100", *BAD], USAGE,
     "argument --upload-part-bytes: must be at least 5242880, got 100"),
    (["sink", "--output", "{locked}/out", *BAD], USAGE, "{locked} is not writable"),
    (["run", "/nonexistent.jsonl", "--model", "{tiny}", "--output", "{tmp}/o"], USAGE,
     "cannot read /nonexistent.jsonl"),
    (["run", "{prompts}", "--model", "/nonexistent", "--output", "{tmp}/o"], USAGE,
     "--model /nonexistent: no such directory"),
    (["run", "{prompts}", "--model", "{config_only}", "--output", "{tmp}/o"], USAGE, "no weights in it"),
    (["run", "{prompts}", "--model", "{tiny}", "--output", "/proc/x"], USAGE, "/proc is on a virtual filesystem"),
    (["run", "{prompts}", "--model", "{tiny}", "--output", "{tmp}/o", "--partitions", "0"], USAGE,
     "argument --partitions: must be at least 1, got 0"),
    (["run", "{prompts}", "--model", "{tiny}", "--output", "{tmp}/o", "--layers", "1,99"], USAGE,
     "layer ids go up to num_hidden_layers = 4"),
    (["run", "{hf}", "--model", "{tiny}", "--output", "{hf}/out"], USAGE, "--output {hf}/out: inside INPUT {hf}"),
    (["run", "{prompts}", "--model", "{tiny}", "--output", "{tmp}/o", "--engine-arg", "pipeline_parallel_size=2"],
     USAGE, "hsx run: --engine-arg pipeline_parallel_size 2: hidden-state extraction does not support"),
    (["inspect", "/nonexistent"], USAGE, "hsx inspect: no dataset at /nonexistent"),
    (["inspect", "{empty}"], USAGE, "no index in it, so not a dataset written by hsx sink"),
    (["inspect", "{prompts}"], USAGE, "a file, but not a shard"),
    (["inspect", "{dataset}", "--sample", "nope"], USAGE, "--sample nope: no such sample"),
    (["inspect", "gs://bucket/x"], USAGE, "dataset gs://bucket/x: gs:// is not supported"),
    (["export", "{tmp}/x", "--dataset", "/nonexistent", "--format", "speculators"], USAGE,
     "--dataset /nonexistent: no such directory"),
    (["export", "{dataset}/exported", "--dataset", "{dataset}"], USAGE, "inside --dataset {dataset}"),
    (["export", "{tmp}", "--dataset", "{dataset}"], USAGE, "OUT {tmp}: exists; choose a new directory"),
    (["export", "{tmp}/x", "--dataset", "s3://"], USAGE, "s3://: an object-store dataset is s3://BUCKET[/PREFIX]"),
    (["export", "{tmp}/x", "--dataset", "{dataset}", "--format", "eagle"], USAGE,
     "argument --format: invalid choice: 'eagle'"),
    (["eval-draft", "{prompts}", "--model", "{tiny}", "--draft", "/nonexistent"], USAGE,
     "hsx eval-draft: --draft /nonexistent: no such directory"),
    (["eval-draft", "{prompts}", "--model", "{tiny}", "--draft", "{tiny}"], USAGE,
     "--draft {tiny}: config.json's speculators_model_type is None; this takes EAGLE-3, DFlash or P-EAGLE "
     "checkpoints"),
    (["eval-draft", "{prompts}", "--model", "{tiny}", "--draft", "{empty}"], USAGE,
     "--draft {empty}: no config.json, so not a draft checkpoint"),
    (["eval-draft", "{prompts}", "--model", "{tiny}", "--draft", "{draft}/no-weights"], USAGE,
     "no *.safetensors weights beside config.json"),
    (["eval-draft", "{prompts}", "--model", "{tiny}", "--draft", "{draft}/other-verifier"], USAGE,
     "is not a draft for this model (built for verifier-576x49152): it expects hidden size 576, the model has "
     "128; its vocabulary is 49152 tokens, the model's 1000"),
    (["eval-draft", "{prompts}", "--model", "{tiny}", "--draft", "{draft}/aux-past-the-layers"], USAGE,
     "its aux layer ids [1, 2, 4] go past the model's 4 layers (0..3)"),
    (["eval-draft", "/nonexistent.jsonl", "--model", "{tiny}", "--draft", "{draft}/good"], USAGE,
     "cannot read /nonexistent.jsonl"),
    (["eval-draft", "{prompts}", "--model", "/nonexistent", "--draft", "{draft}/good"], USAGE,
     "--model /nonexistent: no such directory"),
    (["eval-draft", "{prompts}", "--model", "{tiny}", "--draft", "{draft}/good", "--generate", "max_tokens=4"], USAGE,
     "--generate/--turns do not apply: eval-draft decodes every prompt greedily"),
    (["eval-draft", "{prompts}", "--model", "{tiny}", "--draft", "{draft}/good", "--num-speculative-tokens", "0"],
     USAGE, "argument --num-speculative-tokens: must be at least 1, got 0"),
    (["eval-draft", "{prompts}", "--model", "{tiny}", "--draft", "{draft}/good", "--json", "/nonexistent/r.json"],
     USAGE, "--json /nonexistent/r.json: no directory /nonexistent"),
    (["models", "prepare", "--dir", "/proc/x"], USAGE, "--dir /proc/x: /proc is on a virtual filesystem"),
    (["models", "bake"], USAGE, "argument ACTION: invalid choice: 'bake'"),
    (["demo", "--output", "/proc/x"], USAGE, "--output /proc/x: /proc is on a virtual filesystem"),
    (["demo", "--output", "{prompts}"], USAGE, "exists and is not a directory"),
    (["demo", "--output", "{tmp}"], USAGE, "which is not an hsx dataset; the demo empties its output"),
    (["--log-level", "LOUD", "inspect", "x"], USAGE, "argument --log-level: invalid choice: 'LOUD'"),
    (["frobnicate"], USAGE, "argument COMMAND: invalid choice: 'frobnicate'"),
]

# Rows that reach the network, where nothing answers: exit 3 within the timeout.
UNREACHABLE = [
    (["produce", "{prompts}", *BAD, "--connect-timeout", "1", "--no-progress"], UNAVAILABLE,
     "hsx produce: no Kafka cluster answered at 127.0.0.1:1 within 1s (--connect-timeout)"),
    (["extract", "--model", "{tiny}", *BAD, "--connect-timeout", "1"], UNAVAILABLE,
     "hsx extract: no Kafka cluster answered at 127.0.0.1:1 within 1s"),
    (["sink", "--output", "{tmp}/out", *BAD, "--connect-timeout", "1"], UNAVAILABLE,
     "hsx sink: no Kafka cluster answered at 127.0.0.1:1 within 1s"),
    (["run", "{prompts}", "--model", "{tiny}", "--output", "{tmp}/o", *BAD, "--connect-timeout", "1"], UNAVAILABLE,
     "hsx run: no Kafka cluster answered at 127.0.0.1:1 within 1s"),
]


@pytest.fixture(scope="module")
def places(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """What the placeholders stand for; the port stays busy for the whole module."""
    root = tmp_path_factory.mktemp("cli-errors")
    (root / "config_only").mkdir()
    (root / "config_only" / "config.json").write_text("{}")
    (root / "empty").mkdir()
    (root / "dataset" / "index").mkdir(parents=True)
    (root / "rows.csv").write_text("a,b\n")
    hf = write_hf_dataset(text_rows(3), root / "hf")
    write_draft(root / "draft" / "good")
    write_draft(root / "draft" / "no-weights", weights=False)
    write_draft(root / "draft" / "other-verifier", hidden=576, vocab=49152)
    write_draft(root / "draft" / "aux-past-the-layers", aux=[1, 2, 4])
    with _locked_directory(root / "locked"), socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        yield {"tiny": str(models.prepare(names=["tiny-llama"])["tiny-llama"]),
               "vlm": str(models.prepare(names=["tiny-qwen2.5-vl"])["tiny-qwen2.5-vl"]),
               "prompts": str(write_jsonl([{"prompt": "hi"}], root / "prompts.jsonl")), "tmp": str(root),
               "config_only": str(root / "config_only"), "empty": str(root / "empty"),
               "dataset": str(root / "dataset"), "locked": str(root / "locked"), "hf": str(hf),
               "busy": str(busy.getsockname()[1]), "draft": str(root / "draft")}


@contextlib.contextmanager
def _locked_directory(path: Path) -> Iterator[None]:
    """A directory hsx may not write to. Permission bits do not stop root (CI runs
    as root), so there it is a read-only mount, which stops everyone."""
    path.mkdir(mode=0o500)
    with tmpfs(path, "ro,size=64k") if os.geteuid() == 0 else contextlib.nullcontext():
        yield


@pytest.fixture(autouse=True)
def _plain_environment(monkeypatch: pytest.MonkeyPatch, restore_root_logging: None) -> None:
    """No ``HSX_*`` or ``VLLM_*`` settings but the model cache; and ``main``'s
    logging configuration undone after each row."""
    for name in list(os.environ):
        if name.startswith(("HSX_", "VLLM_")) and name != models.CACHE_DIR_ENV:
            monkeypatch.delenv(name)


def _fill(words: list[str], places: dict[str, str]) -> list[str]:
    return [word.format(**places) for word in words]


def _main(argv: list[str]) -> int:
    try:
        return main(argv)
    except SystemExit as exc:  # argparse's errors
        return int(exc.code or 0)


def _the_error_line(output: str, phrase: str) -> None:
    """Exactly one error line, and it holds ``phrase``; no traceback."""
    assert "Traceback" not in output, output
    lines = [line for line in output.splitlines() if ERROR_LINE.search(line)]
    assert len(lines) == 1, output
    assert phrase in lines[0], output


@pytest.mark.parametrize(("argv", "code", "phrase"), LOCAL + UNREACHABLE, ids=_row_id)
def test_a_bad_invocation_is_one_line_and_its_exit_code(
    argv: list[str], code: int, phrase: str, places: dict[str, str], capfd: pytest.CaptureFixture[str]
) -> None:
    """Local rows fail before any Kafka wait or engine line; unreachable ones say
    once that they wait, and no engine starts either (the ``--connect-timeout``
    is 1 s, so both finish well within :data:`LOCAL_SECONDS`)."""
    started = time.monotonic()
    status = _main(_fill(argv, places))
    elapsed = time.monotonic() - started
    out, err = capfd.readouterr()
    assert status == code, out + err
    _the_error_line(out + err, phrase.format(**places))
    if code == UNAVAILABLE:
        assert (out + err).count("waiting for the Kafka cluster") <= 1  # said once, not per retry
        assert not re.search(r"vllm|Initializing", out + err, re.IGNORECASE), "an engine started"
    else:
        assert not ENGINE_OR_WAIT.search(out + err), out + err
    assert elapsed < LOCAL_SECONDS


# Issue 17's five invocations, as a new user types them (the last with a bound).
PLAIN_SHELL = [
    (["export", "{tmp}/x", "--dataset", "/nonexistent", "--format", "speculators"], USAGE, "no such directory", ""),
    (["sink", "--output", "/proc/x", *BAD], USAGE, "/proc is on a virtual filesystem", ""),
    (["extract", "--model", "/nonexistent", *BAD], USAGE, "--model /nonexistent: no such directory", ""),
    (["produce", "/nonexistent.jsonl", *BAD], USAGE, "cannot read /nonexistent.jsonl", ""),
    (["produce", "-", *BAD, "--connect-timeout", "5"], UNAVAILABLE, "within 5s (--connect-timeout)",
     '{"prompt": "hi"}\n'),
]


@pytest.mark.parametrize(("argv", "code", "phrase", "stdin"), PLAIN_SHELL, ids=_row_id)
def test_from_a_plain_shell(argv: list[str], code: int, phrase: str, stdin: str, places: dict[str, str]) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VLLM_", "HSX_")) or k == models.CACHE_DIR_ENV}
    result = subprocess.run([sys.executable, "-m", "hsx.cli", *_fill(argv, places)], input=stdin, env=env,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == code, result.stderr
    _the_error_line(result.stdout + result.stderr, phrase)
    assert not Path(places["tmp"], "x").exists()  # nothing written for a command that failed
    if code == UNAVAILABLE:  # several tries in 5 s, one line about the wait
        assert result.stderr.count("waiting for the Kafka cluster at 127.0.0.1:1") == 1, result.stderr
