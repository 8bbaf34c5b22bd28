"""bench/gpu_draft.py's own logic on a tiny synthetic export (the real run needs
a GPU host): the bundle rebuilds the export's files bit for bit, repeats them,
and its slim verifier keeps exactly the rows training reads."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from datasets import load_from_disk
from safetensors.torch import load_file, save_file

from bench import gpu_draft, report
from hsx.local.training_data import TrainingDataSpec, write_training_dataset
from hsx.schemas import DType
from hsx.trainer.export import export_speculators

VOCAB, HIDDEN, DRAFT_VOCAB = 128, 16, 8
FLAGS = {"--speculator-type": ["eagle3"], "--verifier-name-or-path": ["/m"], "--data-path": ["/e"],
         "--draft-vocab-size": [str(DRAFT_VOCAB)], "--epochs": ["2"], "--save-path": ["/d"]}


@pytest.fixture
def inputs(tmp_path: Path) -> tuple[Path, Path]:
    """An export of 6 bf16 samples with a draft vocabulary, and a verifier with
    weights speculators loads and one it does not."""
    write_training_dataset(tmp_path / "ds", TrainingDataSpec(samples=6, min_tokens=4, dtype=DType.BFLOAT16,
                                                             hidden_size=HIDDEN))
    export = tmp_path / "export"
    export_speculators(tmp_path / "ds", export, layers=[1, 2])
    t2d = np.zeros(VOCAB, dtype=bool)
    t2d[[100, 101, 105, 110, 115, 120, 125, 127]] = True  # outside the samples' token ids (< 97)
    np.save(export / f"t2d-{DRAFT_VOCAB}.npy", t2d)
    np.save(export / f"d2t-{DRAFT_VOCAB}.npy", np.flatnonzero(t2d) - np.arange(DRAFT_VOCAB))
    verifier = tmp_path / "verifier"
    verifier.mkdir()
    (verifier / "config.json").write_text(json.dumps({"vocab_size": VOCAB, "bos_token_id": 1, "eos_token_id": 2,
                                                      "pad_token_id": None}))
    (verifier / "tokenizer.json").write_text("{}")
    gen = torch.Generator().manual_seed(0)
    save_file({"model.embed_tokens.weight": torch.randn(VOCAB, HIDDEN, generator=gen),
               "model.norm.weight": torch.randn(HIDDEN, generator=gen),
               "model.layers.0.mlp.down_proj.weight": torch.randn(HIDDEN, HIDDEN, generator=gen)},
              str(verifier / "model.safetensors"))
    return export, verifier


def test_the_bundle_rebuilds_the_export_repeated_and_a_slim_verifier(inputs: tuple[Path, Path],
                                                                     tmp_path: Path) -> None:
    export, verifier = inputs
    first = load_file(str(export / "hidden_states" / "hs_0.safetensors"))["hidden_states"]
    one_row = len(gpu_draft.encode_tensor(first))
    manifest = gpu_draft.pack(export, verifier, tmp_path / "bundle", FLAGS, budget_bytes=3 * one_row)
    n = manifest["rows"]
    assert 1 <= n < 6  # the budget cut the rows
    assert manifest["flags"]["--data-path"] == ["{data}"] and manifest["flags"]["--epochs"] == ["2"]

    rebuilt, slim = gpu_draft.unpack(tmp_path / "bundle", tmp_path / "work", repeat=3)
    rows, originals = load_from_disk(str(rebuilt)), load_from_disk(str(export))
    assert len(rows) == 3 * n
    for k in range(3 * n):
        assert torch.equal(rows[k]["input_ids"], originals[k % n]["input_ids"])
        assert (rebuilt / "hidden_states" / f"hs_{k}.safetensors").read_bytes() == \
            (export / "hidden_states" / f"hs_{k % n}.safetensors").read_bytes()
    assert (rebuilt / f"t2d-{DRAFT_VOCAB}.npy").exists() and (rebuilt / "token_freq.pt").exists()

    assert (slim / "tokenizer.json").read_text() == "{}"
    real, ours = load_file(str(verifier / "model.safetensors")), load_file(str(slim / "model.safetensors"))
    assert set(ours) == {"model.embed_tokens.weight", "model.norm.weight"}
    assert torch.equal(ours["model.norm.weight"], real["model.norm.weight"])
    used = {0, 1, 2, 100, 101, 105, 110, 115, 120, 125, 127}
    for row in range(n):
        used.update(originals[row]["input_ids"].tolist())
    kept = set(torch.nonzero(ours["model.embed_tokens.weight"].any(dim=1)).flatten().tolist())
    assert kept == used and manifest["verifier"]["rows_kept"] == len(used)
    index = torch.tensor(sorted(used))
    assert torch.equal(ours["model.embed_tokens.weight"][index], real["model.embed_tokens.weight"][index])


def test_a_bundle_that_does_not_rebuild_its_files_is_refused(inputs: tuple[Path, Path], tmp_path: Path) -> None:
    export, verifier = inputs
    gpu_draft.pack(export, verifier, tmp_path / "bundle", FLAGS)
    manifest = json.loads((tmp_path / "bundle" / gpu_draft.MANIFEST).read_text())
    manifest["hidden_states"][0]["sha256"] = "0" * 64
    (tmp_path / "bundle" / gpu_draft.MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(ValueError, match="hs_0.safetensors rebuilt from the bundle differs"):
        gpu_draft.unpack(tmp_path / "bundle", tmp_path / "work", repeat=1)


def test_steady_throughput_leaves_out_the_first_step_and_epoch_ends() -> None:
    def step(t: float, epoch: int, global_step: int, loss: float) -> dict[str, object]:
        return {"t": t, "epoch": epoch, "global_step": global_step, "train": {"loss": loss},
                "profile": {"tokens_per_s": 2000.0, "step_ms": 1000.0}}

    records = [step(0.0, 0, 0, 9.0), step(100.0, 0, 10, 8.0), step(102.0, 0, 20, 7.0),  # step 0 compiles
               {"t": 150.0, "val": {"loss_epoch": 5.0, "full_acc_0_epoch": 0.5, "full_acc_1_epoch": 0.25}},
               step(160.0, 1, 30, 6.0), step(162.0, 1, 40, 5.5), {"t": 170.0, "peak_allocated": 2**31,
                                                                   "peak_reserved": 2**32}]
    figures = gpu_draft.summarize(records, tokens_per_step=1000.0)
    assert figures["steady_steps_per_s"] == 5.0  # 20 steps in 4 s: 10->20 and 30->40, not 20->30 (validation)
    assert figures["steady_tokens_per_s"] == 5000.0
    assert figures["loss_first"] == 9.0 and figures["loss_last"] == 5.5
    assert figures["val_full_acc"] == [0.5, 0.25] and figures["val_loss"] == 5.0
    assert figures["peak_memory_gib"] == 2.0 and figures["peak_reserved_gib"] == 4.0
    assert gpu_draft.summarize(records, None)["steady_tokens_per_s"] == 10_000.0  # the logged steps' 2,000 tokens


def test_the_page_shows_the_gpu_section_only_with_its_figures() -> None:
    assert "## On a GPU host" not in report.render({})
    page = report.render({"gpu_device": "NVIDIA H200", "gpu_codec_threads_1_encode_mb_s": 500.0,
                          "gpu_codec_threads_1_decode_mb_s": 900.0})
    assert "## On a GPU host" in page and "| 1 | 500.0 | 900.0 |" in page and "**Draft training.**" not in page
    page = report.render({"gpu_device": "NVIDIA H200", "gpu_draft_train_s": 196.5, "gpu_draft_steps": 852,
                          "gpu_draft_steady_steps_per_s": 26.6, "gpu_draft_speedup_vs_cpu": 21.7})
    assert "| 32.0 |" in page and "| 21.7× |" in page
