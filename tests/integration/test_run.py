"""``hsx run`` from a plain shell (no ``VLLM_*`` or ``HSX_*`` variables): the
whole pipeline on its own embedded broker, finished by accounting rather than
idle timeouts, resumed on the same output, with dead letters reported; by
reference by default (a staging folder beside the dataset), inline on request."""

from __future__ import annotations

import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import orjson
import pytest

from hsx import models
from hsx.dataset.reader import open_dataset
from hsx.dataset.index import read_indexes
from hsx.dataset.storage import LocalStorage
from hsx.reference import HFReference, max_relative_error
from hsx.schemas import sample_id

pytestmark = [pytest.mark.integration, pytest.mark.engine]

ENGINE = ["--dtype", "float32", "--enforce-eager", "--max-model-len", "256"]


HUMAN_EVAL = "HumanEval/0"
"""An id as a real dataset has it: no path or tensor name can take it as it is."""


def _prompts(ids: range) -> list[dict[str, object]]:
    chats = [{"role": "user", "content": "what is a draft model?"}, {"role": "assistant", "content": "a small one"}]
    return [{"request_id": f"run-{i}", "prompt": f"prompt number {i} about speculative decoding"} if i % 2 else
            {"request_id": f"run-{i}", "messages": chats} for i in ids] + [
        {"request_id": HUMAN_EVAL, "prompt": "def add(a, b):\n"}]


def _hsx_run(tmp_path: Path, name: str, prompts: list[dict[str, object]], output: Path,
             model: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    source = tmp_path / f"{name}.jsonl"
    source.write_bytes(b"\n".join(orjson.dumps(p) for p in prompts) + b"\n")
    plain = {k: v for k, v in os.environ.items() if not k.startswith(("VLLM_", "HSX_"))}
    return subprocess.run([sys.executable, "-m", "hsx.cli", "run", str(source), "--model", str(model), "--output",
                           str(output), "--no-progress", *ENGINE, *extra], env=plain, capture_output=True, text=True,
                          timeout=900)


def _row(stdout: str, name: str) -> str:
    """The value of one row of the summary table."""
    line = next(line for line in stdout.splitlines() if line.strip().startswith(name))
    return line.strip()[len(name):].strip()


def test_run_extracts_resumes_and_reports_dead_letters(tmp_path: Path) -> None:
    model = models.prepare(names=["tiny-llama"])["tiny-llama"]
    output = tmp_path / "dataset"

    first = _hsx_run(tmp_path, "first", _prompts(range(6)), output, model)
    assert first.returncode == 0, first.stdout + first.stderr[-4000:]
    assert _row(first.stdout, "samples written") == "7"
    assert _row(first.stdout, "lost") == "0"
    dataset = open_dataset(output)
    assert sorted(dataset.request_ids()) == sorted([f"run-{i}" for i in range(6)] + [sample_id(HUMAN_EVAL)])
    assert dataset.event(HUMAN_EVAL).source_request_id == HUMAN_EVAL  # found by the id it had, which it keeps
    assert dataset[HUMAN_EVAL]["request_id"] == sample_id(HUMAN_EVAL) != HUMAN_EVAL
    sample = dataset["run-1"]
    reference = HFReference(model).hidden_states(sample["token_ids"].tolist(), dataset.event("run-1").layer_ids)
    assert max_relative_error(sample["hidden_states"], reference) <= 1e-4
    # By default the hidden states go by reference through a staging folder beside
    # the dataset, emptied at the end: Kafka carried manifests only.
    row_bytes = sample["hidden_states"][0].numel() * sample["hidden_states"].element_size()
    assert _row(first.stdout, "transport") == f"by reference, staged in {output / 'staging'}"
    assert not (output / "staging").exists()
    assert float(_row(first.stdout, "Kafka bytes per token (blocks topic)").replace(",", "")) < 0.05 * row_bytes

    # The same output again: the first seven are skipped, two new ones are added, and
    # one prompt longer than --max-model-len is dead-lettered (so the run fails). This
    # run sends fp8 and stores byteplane-zstd (dequantized): the dataset mixes codecs.
    too_long = {"request_id": "run-long", "token_ids": list(range(5, 400))}
    second = _hsx_run(tmp_path, "second", _prompts(range(8)) + [too_long], output, model,
                      "--wire-dtype", "fp8", "--dataset-codec", "byteplane-zstd", "--inline")
    assert second.returncode == 1, second.stdout + second.stderr[-4000:]
    assert _row(second.stdout, "skipped (already in the dataset)") == "7"  # HumanEval/0 by its sample id
    assert _row(second.stdout, "samples written") == "2"
    assert _row(second.stdout, "dead letters") == "1 (prompt_too_long 1)"
    assert _row(second.stdout, "lost") == "0"
    assert _row(second.stdout, "transport") == "inline (block records through Kafka)"
    # fp8 codes, a byte an element, plus a scale per token and layer, crossed Kafka.
    assert float(_row(second.stdout, "Kafka bytes per token (blocks topic)").replace(",", "")) > 0.2 * row_bytes
    counts = Counter(e.request_id for index in read_indexes(LocalStorage(output)) for e in index.events)
    assert counts == Counter({**{f"run-{i}": 1 for i in range(8)}, sample_id(HUMAN_EVAL): 1})
    mixed = open_dataset(output)
    assert {mixed.event(f"run-{i}").codec.value for i in range(8)} == {"raw", "byteplane-zstd"}
    assert mixed.event("run-7").codec.value == "byteplane-zstd"
    sample = mixed["run-7"]
    reference = HFReference(model).hidden_states(sample["token_ids"].tolist(), mixed.event("run-7").layer_ids)
    assert 0 < max_relative_error(sample["hidden_states"], reference) <= 2 ** -4 + 1e-4  # fp8's bound (schemas/fp8.py)
