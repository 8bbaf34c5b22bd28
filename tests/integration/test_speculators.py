"""hsx's loader and collate against speculators' own code (0.9.0, in
.venv-speculators: ``make speculators``): the same dataset, exported for
speculators and read by hsx, gives equal batches tensor for tensor, and the
export's token_freq.pt equals what speculators computes from the export."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch.utils.data import DataLoader

from hsx.local.training_data import TrainingDataSpec, write_training_dataset
from hsx.schemas.training import SpeculatorType
from hsx.trainer import HsxDataset, PackedCollate
from hsx.trainer.export import export_speculators

ROOT = Path(__file__).resolve().parents[2]
SPECULATORS_PY = ROOT / ".venv-speculators" / "bin" / "python"
TOTAL = 64
# Row groups as a batch sampler would pick them; the last one overflows TOTAL,
# so the cut of the last sample and the samples left out are compared too.
BATCHES = [[0, 1, 2], [3], [4, 5, 6, 7, 8, 9, 10], [11, 12]]
AUX = [3, 1]  # not ascending: the slot order a draft config asks for


@pytest.fixture(scope="module")
def side_by_side(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    if not SPECULATORS_PY.exists():
        pytest.fail(f"{SPECULATORS_PY} is missing: run `make speculators`")
    tmp = tmp_path_factory.mktemp("speculators")
    dataset = tmp / "ds"
    write_training_dataset(dataset, TrainingDataSpec(samples=18, unsupervised_every=7), partitions=2)
    metadata = export_speculators(dataset, tmp / "export", layers=AUX)
    assert metadata.dropped_unsupervised == 2 and metadata.layer_ids == [3, 1, 4]
    spec = {"total_seq_len": TOTAL, "dtype": "bfloat16", "hidden_size": 16, "batches": BATCHES}
    run = subprocess.run([str(SPECULATORS_PY), str(Path(__file__).with_name("speculators_batches.py")),
                          str(tmp / "export"), str(tmp / "theirs"), json.dumps(spec)],
                         capture_output=True, text=True, timeout=600, check=False)
    assert run.returncode == 0, run.stderr[-3000:]
    return dataset, tmp / "export", tmp / "theirs"


def test_batches_equal_speculators_tensor_for_tensor(side_by_side: tuple[Path, Path, Path]) -> None:
    dataset, _export, theirs = side_by_side
    expected = load_file(str(theirs / "batches.safetensors"))
    ours = HsxDataset(dataset, layers=AUX)
    loader = DataLoader(ours, batch_sampler=BATCHES, num_workers=2, collate_fn=PackedCollate(TOTAL, torch.bfloat16))
    compared = 0
    for b, batch in enumerate(loader):
        keys = {k.split("/", 1)[1] for k in expected if k.startswith(f"{b}/")}
        assert keys == {"hidden_states", "verifier_last_hidden_states", "input_ids", "loss_mask", "position_ids",
                        "document_ids", "error_records"}
        for key in keys:
            mine = batch[key] if isinstance(batch[key], torch.Tensor) else torch.tensor(batch[key])
            theirs_t = expected[f"{b}/{key}"]
            assert mine.dtype == theirs_t.dtype and mine.shape == theirs_t.shape, (b, key)
            assert torch.equal(mine, theirs_t), (b, key)
            compared += 1
        # speculators computes the packed lengths but drops them; hsx keeps them, consistent with document_ids
        documents = batch["document_ids"][0]
        assert batch["lengths"].tolist() == torch.bincount(documents[documents >= 0]).tolist()
    assert compared == 7 * len(BATCHES)
    assert batch["hidden_states"].abs().sum() > 0  # real values were compared, not zeros


def test_token_freq_equals_speculators(side_by_side: tuple[Path, Path, Path]) -> None:
    _dataset, export, theirs = side_by_side
    ours = torch.load(export / "token_freq.pt", weights_only=True)
    assert ours == torch.load(theirs / "token_freq.pt", weights_only=True)
    metadata = json.loads((export / "hsx_export.json").read_text())
    assert sum(ours.values()) == metadata["supervised_tokens"] > 0


@pytest.fixture
def printed_command(tmp_path: Path, cache_dir: Path) -> list[str]:
    return tiny_train_flags(tmp_path, cache_dir)


def tiny_train_flags(tmp_path: Path, cache_dir: Path, layers: list[int] = AUX,
                     speculator_type: SpeculatorType = "eagle3") -> list[str]:
    """The flags of the ``speculators train`` command ``hsx export`` prints for
    an export (of aux ``layers``, for a ``speculator_type`` draft) of
    tiny-llama-shaped samples, with a small draft vocabulary."""
    from hsx import models
    from hsx.trainer.export import train_command

    tiny = models.prepare(cache_dir, names=["tiny-llama"])["tiny-llama"]
    config = json.loads((tiny / "config.json").read_text())
    write_training_dataset(tmp_path / "ds", TrainingDataSpec(
        samples=12, hidden_size=config["hidden_size"], vocab=config["vocab_size"], model=str(tiny)))
    metadata = export_speculators(tmp_path / "ds", tmp_path / "export", layers=layers, speculator_type=speculator_type)
    argv = train_command(tmp_path / "export", metadata).split()
    assert argv[:2] == ["speculators", "train"]
    argv[argv.index("--draft-vocab-size") + 1] = "200"
    return argv[2:]


def run_speculators(argv: list[str], cwd: Path) -> None:
    run = subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=600, check=False)
    assert run.returncode == 0, run.stderr[-3000:]


def test_the_printed_train_command_is_accepted(tmp_path: Path, printed_command: list[str]) -> None:
    """``speculators train`` with the command ``hsx export`` prints (a dry run)
    builds the vocabulary mapping from token_freq.pt and a draft fed by the
    chosen aux layers in their order."""
    run_speculators([str(SPECULATORS_PY.with_name("speculators")), "train", *printed_command,
                  "--dry-run", "--save-path", str(tmp_path / "draft")], tmp_path)
    assert (tmp_path / "export" / "d2t-200.npy").exists() and (tmp_path / "export" / "t2d-200.npy").exists()
    draft = json.loads((tmp_path / "draft" / "config.json").read_text())
    assert draft["eagle_aux_hidden_state_layer_ids"] == AUX and draft["draft_vocab_size"] == 200


def test_the_printed_train_command_trains_on_a_cpu(tmp_path: Path, printed_command: list[str]) -> None:
    """The same flags through ``python -m hsx.trainer.speculators_cpu``
    (speculators' own train, adapted for a machine without an accelerator)
    train: the epoch's checkpoint holds the initial draft's tensors, changed."""
    run_speculators([str(SPECULATORS_PY.with_name("speculators")), "train", *printed_command,
                  "--dry-run", "--save-path", str(tmp_path / "initial")], tmp_path)
    run_speculators([str(SPECULATORS_PY), "-m", "hsx.trainer.speculators_cpu", *printed_command,
                  "--epochs", "1", "--save-path", str(tmp_path / "trained")], tmp_path)
    initial = load_file(str(tmp_path / "initial" / "model.safetensors"))
    trained = load_file(str(tmp_path / "trained" / "0" / "model.safetensors"))
    assert set(trained) == set(initial)
    assert all(torch.isfinite(t).all() for t in trained.values())
    changed = [k for k in trained if not torch.equal(trained[k].float(), initial[k].float())]
    assert "fc.weight" in changed and any(".self_attn." in k for k in changed), changed
