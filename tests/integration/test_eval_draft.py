"""``hsx eval-draft`` from a plain shell, on a real engine: the tiny verifier with
a draft trained in the test, every way hsx offers: speculators' own train
(through hsx.trainer.speculators_cpu) for an epoch on an ``hsx export`` (an
EAGLE-3, a DFlash and a P-EAGLE draft, each with the command the export
printed for its type), and ``hsx train-draft`` for a few steps from ready
events on the broker. Each has a reduced draft vocabulary (so vLLM maps its
tokens through the checkpoint's d2t). vLLM serves each with the method it
reads from the checkpoint; the report's counts come from vLLM's counters and
must agree with each other; greedy outputs must not change with the draft."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from hsx import models
from hsx.runtime.draft_types import TYPES
from hsx.local.training_data import TrainingDataSpec, write_training_dataset
from hsx.runtime.settings import KafkaSettings
from hsx.schemas.training import SpeculatorType
from tests.integration.test_speculators import SPECULATORS_PY, run_speculators, tiny_train_flags
from tests.integration.test_train_draft import SAMPLES, SPECULATORS_BIN, publish_ready, train_draft
from tests.unit.input_files import write_jsonl

pytestmark = [pytest.mark.integration, pytest.mark.engine]
K = 3
DRAFT_VOCAB = 200  # of tiny-llama's 1,000 tokens: tiny_train_flags' --draft-vocab-size


def offline_draft(tmp_path: Path, cache_dir: Path, speculator_type: SpeculatorType = "eagle3") -> Path:
    """Trained by speculators' own train for an epoch on an hsx export."""
    flags = tiny_train_flags(tmp_path, cache_dir, layers=[1, 2, 3], speculator_type=speculator_type)  # ascending
    run_speculators([str(SPECULATORS_PY), "-m", "hsx.trainer.speculators_cpu", *flags, "--epochs", "1",
                     "--save-path", str(tmp_path / "trained")], tmp_path)
    draft = tmp_path / "trained" / "0"
    config = json.loads((draft / "config.json").read_text())
    assert config["draft_vocab_size"] == DRAFT_VOCAB and config["speculators_model_type"] == speculator_type
    return draft


def online_draft(tmp_path: Path, cache_dir: Path, kafka: KafkaSettings, speculator_type: SpeculatorType = "eagle3"
                 ) -> Path:
    """Trained by ``hsx train-draft`` from a live stream of ready events, 3 steps."""
    tiny = models.prepare(cache_dir, names=["tiny-llama"])["tiny-llama"]
    config = json.loads((tiny / "config.json").read_text())
    events = write_training_dataset(tmp_path / "ds", TrainingDataSpec(
        samples=SAMPLES, min_tokens=16, max_tokens=30, layer_ids=(1, 2, 3, config["num_hidden_layers"]),
        hidden_size=config["hidden_size"], vocab=config["vocab_size"], model=str(tiny)), partitions=1)
    topic = publish_ready(kafka, events)
    steps, _ = train_draft(SPECULATORS_BIN / "hsx", kafka, topic, f"draft-{uuid.uuid4().hex}", tmp_path / "ds", tiny,
                           tmp_path / "draft", "--steps", "3", "--speculator-type", speculator_type)
    assert [s["step"] for s in steps] == [1, 2, 3]
    draft = tmp_path / "draft" / "0"
    config = json.loads((draft / "config.json").read_text())
    assert config["speculators_model_type"] == speculator_type and config[TYPES[speculator_type].aux_key] == [1, 2, 3]
    return draft


METHODS: dict[SpeculatorType, dict[str, object]] = {
    "eagle3": {"method": "eagle3"}, "dflash": {"method": "dflash"},
    "peagle": {"method": "eagle3", "parallel_drafting": True}}
"""How vLLM serves each type (its SpeculatorsConfig's reading of the checkpoint)."""


@pytest.mark.parametrize("kind", list(METHODS))
@pytest.mark.parametrize("trained", ["offline", "online"])
def test_eval_draft_reports_consistent_counts_and_identical_outputs(tmp_path: Path, cache_dir: Path,
                                                                    kafka: KafkaSettings, trained: str,
                                                                    kind: SpeculatorType) -> None:
    tiny = models.prepare(cache_dir, names=["tiny-llama"])["tiny-llama"]
    draft = (online_draft(tmp_path, cache_dir, kafka, kind) if trained == "online"
             else offline_draft(tmp_path, cache_dir, kind))
    # EAGLE-3 drafts at K tokens a step; the others at what their checkpoint says (DFlash's block less one, ...)
    trained_for = json.loads((draft / "config.json").read_text())["speculators_config"]["proposal_methods"][0]
    k = K if kind == "eagle3" else trained_for["speculative_tokens"]
    prompts = write_jsonl([{"request_id": "text", "prompt": "The capital of France is"},
                           {"request_id": "chat", "messages": [{"role": "user", "content": "Tell me a story."}]},
                           {"request_id": "ids", "token_ids": [5, 17, 300, 41]}], tmp_path / "prompts.jsonl")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VLLM_", "HSX_")) or k == models.CACHE_DIR_ENV}
    report_file = tmp_path / "report.json"
    run = subprocess.run([str(Path(sys.executable).with_name("hsx")), "eval-draft", str(prompts), "--model", str(tiny),
                          "--draft", str(draft), "--max-tokens", "12",
                          *(["--num-speculative-tokens", str(K)] if kind == "eagle3" else []),
                          "--enforce-eager", "--json", str(report_file)],
                         env=env, capture_output=True, text=True, timeout=600, check=False)
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(report_file.read_text())
    assert report["prompts"] == 3 and report["invalid_rows"] == 0
    assert report["speculative_config"] == {**METHODS[kind], "model": str(draft), "num_speculative_tokens": k}
    assert report["outputs_identical"] and report["differing_prompts"] == []
    assert report["generated_tokens_with_draft"] == report["generated_tokens_without_draft"] > 0
    assert report["drafts"] > 0 and report["draft_tokens"] == k * report["drafts"]
    assert 0 <= report["accepted_tokens"] <= report["draft_tokens"]
    rates = report["per_position"]
    assert len(rates) == k and all(a >= b for a, b in zip(rates, rates[1:])) and all(0 <= r <= 1 for r in rates)
    assert sum(rates) * report["drafts"] == pytest.approx(report["accepted_tokens"])
    assert "mean acceptance length" in run.stdout
