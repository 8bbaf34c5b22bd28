"""bench/acceptance.py's own logic: the arms' exports and flags, and its page."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

import torch
from safetensors.torch import load_file

from bench import acceptance, report, report_acceptance, speculators_run
from bench.acceptance_arms import write_shifted_export
from hsx.local.training_data import TrainingDataSpec, write_training_dataset
from hsx.trainer.export import export_speculators


def test_shifted_export_moves_every_hidden_state_one_position_late(tmp_path: Path) -> None:
    write_training_dataset(tmp_path / "ds", TrainingDataSpec(samples=6, min_tokens=4))
    export_speculators(tmp_path / "ds", tmp_path / "export", layers=[1, 2])
    write_shifted_export(tmp_path / "export", tmp_path / "shifted")
    files = sorted((tmp_path / "export" / "hidden_states").glob("hs_*.safetensors"))
    assert len(files) == 6
    for path in files:
        ours, shifted = load_file(str(path)), load_file(str(tmp_path / "shifted" / "hidden_states" / path.name))
        assert torch.equal(shifted["token_ids"], ours["token_ids"])
        assert torch.equal(shifted["hidden_states"][1:], ours["hidden_states"][:-1])
        assert torch.equal(shifted["hidden_states"][0], ours["hidden_states"][0])
        assert not torch.equal(shifted["hidden_states"], ours["hidden_states"])
    # The rows (tokens, masks), their counts and the export's record are the export's own.
    for name in ("hsx_export.json", "token_freq.pt", "dataset_info.json"):
        assert (tmp_path / "shifted" / name).read_bytes() == (tmp_path / "export" / name).read_bytes()


def test_every_arm_trains_with_the_printed_command_and_the_same_flags(tmp_path: Path) -> None:
    work = acceptance.Work(tmp_path)
    work.figures("export").parent.mkdir(parents=True)
    printed = ("speculators train --speculator-type eagle3 --verifier-name-or-path /m --data-path /e "
               "--target-layer-ids 2 15 27 --hidden-states-dtype bfloat16 --on-missing raise "
               "--total-seq-len 8192 --draft-vocab-size 32000")
    work.figures("export").write_text(json.dumps({"acceptance_printed_command": printed}))
    offline, shifted = acceptance.arm_flags(work, "offline"), acceptance.arm_flags(work, "shifted")
    assert offline["--target-layer-ids"] == ["2", "15", "27"] and offline["--verifier-name-or-path"] == ["/m"]
    assert offline["--draft-vocab-size"] == ["8192"] and offline["--total-seq-len"] == ["2048"]
    assert offline["--data-path"] == [str(tmp_path / "export")] and shifted["--data-path"] == [str(tmp_path / "export-shifted")]
    assert {k: v for k, v in offline.items() if k not in ("--data-path", "--save-path")} == \
        {k: v for k, v in shifted.items() if k not in ("--data-path", "--save-path")}
    for arm, data, seed in (("dflash", "offline", 0), ("peagle_reference", "reference", 0),
                            ("dflash_shifted", "shifted", 0), ("peagle_seed1", "offline", 1)):
        kind = arm.split("_")[0]  # each type's arms: (a)'s flags, its type and seed, the data of (a), (c) or (d)
        assert acceptance.TYPE_ARMS[arm] == acceptance.TypeArm(kind, data, seed)
        assert acceptance.TYPE_ARMS[arm].control == (arm != kind) == (arm in acceptance.EPOCH_ARMS)
        flags = acceptance.arm_flags(work, arm, data)
        assert flags.pop("--seed") == [str(seed)] and offline["--seed"] == ["0"]
        flags["--seed"] = ["0"]
        assert flags.pop("--speculator-type") == [kind] and offline.pop("--speculator-type") == ["eagle3"]
        assert flags["--data-path"] == [str(work.export(data))] and flags["--save-path"] == [str(work.draft(arm))]
        assert {k: v for k, v in flags.items() if k not in ("--data-path", "--save-path")} == \
            {k: v for k, v in offline.items() if k not in ("--data-path", "--save-path")}
        offline["--speculator-type"] = ["eagle3"]
    assert set(acceptance.STAGES) >= {"dflash", "dflash_reference", "dflash_shifted", "peagle", "peagle_reference",
                                      "peagle_shifted"}
    untrained = acceptance.train_flags(work, "untrained", data="offline")  # a dry run on (a)'s export
    assert untrained.count("--save-path") == 1
    assert untrained[untrained.index("--save-path") + 1] == str(tmp_path / "drafts" / "untrained")
    assert untrained[untrained.index("--data-path") + 1] == str(tmp_path / "export")
    line = acceptance.train_flags(work, "offline")
    assert line[line.index("--target-layer-ids"):line.index("--target-layer-ids") + 4] == \
        ["--target-layer-ids", "2", "15", "27"]


def test_the_page_shows_arms_run_and_not_run_and_compares_arms_after_as_many_epochs() -> None:
    results = {"acceptance_train_prompts": 2400, "acceptance_offline_acceptance_length": 1.9,
               "acceptance_offline_epochs": 4, "acceptance_offline_epoch1_acceptance_length": 1.5,
               "acceptance_offline_per_position": [0.5, 0.25, 0.15], "acceptance_offline_outputs_identical": True,
               "acceptance_shifted_acceptance_length": 1.2, "acceptance_shifted_per_position": [0.15, 0.04, 0.01],
               "acceptance_shifted_epochs": 4, "acceptance_reference_epochs": 1,
               "acceptance_reference_acceptance_length": 1.52, "acceptance_reference_per_position": [0.4, 0.1, 0.02],
               "acceptance_reference_outputs_identical": True,
               "acceptance_shifted_outputs_identical": False, "acceptance_shifted_differing_prompts": ["a", "b"],
               "acceptance_dflash_acceptance_length": 2.6, "acceptance_dflash_num_speculative_tokens": 15,
               "acceptance_dflash_per_position": [0.6, 0.4, 0.3, 0.2, 0.1] + [0.0] * 10,
               "acceptance_dflash_epochs": 4, "acceptance_dflash_epoch1_acceptance_length": 1.6,
               "acceptance_dflash_epoch1_per_position": [0.4, 0.2] + [0.0] * 13, "acceptance_dflash_epoch1_drafts": 600,
               "acceptance_dflash_reference_acceptance_length": 1.5, "acceptance_dflash_reference_epochs": 1,
               "acceptance_dflash_reference_per_position": [0.35, 0.15] + [0.0] * 13,
               "acceptance_dflash_reference_drafts": 600,
               "acceptance_dflash_shifted_acceptance_length": 1.02, "acceptance_dflash_shifted_epochs": 1,
               "acceptance_dflash_shifted_per_position": [0.02] + [0.0] * 14, "acceptance_dflash_shifted_drafts": 900,
               "acceptance_offline_float32_outputs_identical": True, "acceptance_dflash_float32_outputs_identical": True}
    page = report.render(results)
    section = page[page.index("## Drafts trained"):]
    assert "| (a) offline: `hsx export` + speculators' `train` | 4 | 3 | 1.900 | 0.500 / 0.250 / 0.150 |" in section
    assert "| (c) reference: HF transformers' hidden states, same rows | 1 | 3 | 1.520 |" in section
    assert "| (f) DFlash: (a)'s export, `--speculator-type dflash` | 4 | 15 | 2.600 |" in section
    assert "| (g) P-EAGLE: (a)'s export, `--speculator-type peagle` | not run yet |" in section
    # Beside DFlash's own checkpoint after as many epochs: a difference of 0.1 beyond the noise of 600 drafts each.
    noise = 2 * math.hypot(report_acceptance._noise(results, "dflash_epoch1"),
                           report_acceptance._noise(results, "dflash_reference"))
    assert 0.08 < noise < 0.1
    assert (f"| DFlash on hsx ÷ on HF's hidden states, after as many epochs | 1.600 ÷ 1.500 = 1.067 (+0.100; noise "
            f"±{noise:.3f}) | within noise | **no** |") in section
    assert "| P-EAGLE on hsx ÷ on HF's hidden states, after as many epochs | – |" in section
    # Two seeds of DFlash on hsx's data 0.12 apart after as many epochs: that difference is within the noise.
    seeded = report.render({**results, "acceptance_dflash_seed1_acceptance_length": 1.48,
                            "acceptance_dflash_seed1_epochs": 1})
    assert (f"| DFlash on hsx ÷ on HF's hidden states, after as many epochs | 1.600 ÷ 1.500 = 1.067 (+0.100; noise "
            f"±{noise:.3f}, seeds 0.120 apart) | within noise | yes |") in seeded
    assert "| DFlash shifted control ÷ on hsx, after as many epochs | 1.020 ÷ 1.600 = 0.637 (-0.580; noise" in section
    assert "| ≤ 1.1, below beyond noise | yes |" in section
    assert ("| greedy outputs with each type's draft = without it, in float32 | EAGLE-3 yes, DFlash yes | "
            "identical, every type | **no** |") in section  # P-EAGLE's not measured
    assert "| best acceptance length, any type, on hsx data | 2.600 | ≥ 2.5 | yes |" in section
    assert "| (b) online: `hsx train-draft` while `hsx run` extracts, one pass | not run yet |" in section
    assert "**no**: 2 prompts" in section
    assert "| (a) − (c) reference, after as many epochs | -0.020 | within 0.05 | yes |" in section  # beside epoch 1
    assert "| (a) − (d) shifted control, after as many epochs | 0.700 | at least 0.5 | yes |" in section
    assert "| mean acceptance length, (a) | 1.900 | ≥ 2.0 | **no** |" in section


@pytest.mark.parametrize("arm", ["offline", "dflash"])
def test_each_types_arm_reports_each_checkpoint_it_measures(tmp_path: Path, arm: str) -> None:
    """(b), and (c) and (d) after fewer epochs, are set beside (a)'s checkpoint
    after as many epochs (a type's own arms beside its checkpoint): its figures
    are the arm's too. The checkpoints and their evaluations are made here as
    the stages leave them (so nothing trains)."""
    work = acceptance.Work(tmp_path)
    for epoch in range(work.scale.epochs):
        checkpoint = work.draft(arm) / str(epoch)
        checkpoint.mkdir(parents=True)
        (checkpoint / "training_state.json").write_text(json.dumps({"global_step": 10 * (epoch + 1)}))
    # speculators writes val_metrics.json only where an epoch's loss is its best so far (the first
    # here); the metrics file has every epoch's validation.
    (work.draft(arm) / "0" / "val_metrics.json").write_text(json.dumps({"full_acc_0_epoch": 0.5}))
    (work.draft(arm) / "hsx_metrics.jsonl").write_text("".join(
        json.dumps({"t": 0.0, "val": {"full_acc_0_epoch": 0.5 + epoch / 10}, "epoch": epoch}) + "\n"
        for epoch in range(work.scale.epochs)))
    (work.draft(arm) / "hsx_train_s.json").write_text(json.dumps({"train_s": 60.0}))
    (tmp_path / "eval").mkdir()
    for name, length in ((arm, 2.0), (f"{arm}_epoch1", 1.5), (f"{arm}_epoch2", 1.75)):
        (tmp_path / "eval" / f"{name}.json").write_text(json.dumps({"acceptance_length": length,
                                                                    "per_position": [length - 1, 0, 0]}))
    figures = acceptance.STAGES[arm][0](work)
    assert figures[f"acceptance_{arm}_epoch1_acceptance_length"] == 1.5
    assert figures[f"acceptance_{arm}_epoch2_acceptance_length"] == 1.75
    assert (figures[f"acceptance_{arm}_acceptance_length"], figures[f"acceptance_{arm}_steps"]) == (2.0, 40)
    assert [p["acceptance_length"] for p in figures[f"acceptance_{arm}_curve"]] == [1.5, 1.75, 2.0]
    assert figures[f"acceptance_{arm}_val_full_acc"] == [0.8]  # the last epoch's, though not its best


def test_an_epochs_validation_is_its_last_runs_in_the_metrics_file(tmp_path: Path) -> None:
    """A run stopped and resumed validates an epoch again: the later record is the checkpoint's."""
    records = [{"t": 1, "train": {"loss": 2.0}, "epoch": 0, "global_step": 10},
               {"t": 2, "val": {"loss_epoch": 1.0}, "epoch": 0},
               {"t": 3, "val": {"loss_epoch": 0.9}, "epoch": 0},
               {"t": 4, "val": {"loss_epoch": 0.8}, "epoch": 1}]
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    assert speculators_run.read_metrics(path) == records
    assert speculators_run.validation(records, 0) == {"loss_epoch": 0.9}
    assert speculators_run.validation(records, 1) == {"loss_epoch": 0.8}
    assert speculators_run.validation(records, 2) is None
    assert speculators_run.read_metrics(tmp_path / "not-yet.jsonl") == []


def test_the_noise_of_an_acceptance_length_is_its_standard_error_from_vllms_counters() -> None:
    """vLLM counts, per position, the drafts whose token there was accepted
    (every token before it was): the standard error of the mean accepted count
    follows from those rates alone."""
    accepted = np.random.default_rng(0).choice(4, size=1000, p=[0.4, 0.3, 0.2, 0.1])
    rates = [float(np.mean(accepted >= k)) for k in (1, 2, 3)]
    results = {"acceptance_x_per_position": rates, "acceptance_x_drafts": len(accepted)}
    assert math.isclose(report_acceptance._noise(results, "x"), accepted.std() / math.sqrt(len(accepted)),
                        rel_tol=1e-9)


def test_validation_accuracy_reads_each_types_names() -> None:
    assert acceptance.validation_accuracy({"full_acc_0_epoch": 0.51234, "full_acc_1_epoch": 0.2, "loss_epoch": 3}) \
        == [0.512, 0.2]
    dflash = {"full_acc_epoch": 0.07, "position_10_acc_epoch": 0.1, "position_2_acc_epoch": 0.3,
              "position_1_acc_epoch": 0.5}
    assert acceptance.validation_accuracy(dflash) == [0.5, 0.3, 0.1]
