"""``hsx inspect`` and ``hsx export`` on samples whose answers the verifier
generated, and on last-token samples."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import orjson
import pytest

from hsx.cli import main
from hsx.dataset.sample import Sample
from hsx.dataset.shards import OpenShard, write_shard
from hsx.dataset.storage import LocalStorage
from hsx.runtime.errors import ExitCode
from hsx.sink.assembler import Assembler, Record
from tests.unit.test_assembler import feed, records


pytestmark = pytest.mark.usefixtures("restore_root_logging")  # main() configures the root logger


def _generated(request_id: str) -> Sample:
    """A 10-token sample whose tokens 6..9 (and a final token 77) were generated."""
    recs, _ = records(request_id, tokens=10)
    manifest = orjson.loads(recs[-1].value)
    manifest["loss_mask_spans"] = [[6, 10]]
    manifest["generation"] = {"params": {"max_tokens": 5}, "final_token_id": 77,
                              "turns": [{"token_start": 6, "token_end": 11, "finish_reason": "length"}]}
    recs[-1] = Record(recs[-1].offset, recs[-1].key, orjson.dumps(manifest), recs[-1].headers)
    (sample,) = feed(Assembler(), recs)
    assert isinstance(sample, Sample)
    return sample


def _dataset(tmp_path: Path, *samples: Sample) -> Path:
    shard = OpenShard(topic="hidden_states.blocks", partition=0)
    for sample in samples:
        shard.add(sample)
    write_shard(LocalStorage(tmp_path / "ds"), "ds", shard)
    return tmp_path / "ds"


def test_inspect_shows_each_generated_answer(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = _dataset(tmp_path, _generated("gen-1"))
    assert main(["inspect", str(root)]) == 0
    out = capsys.readouterr().out
    assert "generated    1 samples, 1 answers (length 1)" in out
    assert "answer 0   tokens [6, 11), length" in out and "final token 77" in out
    assert "'max_tokens': 5" in out


def test_export_writes_the_regenerated_conversation(tmp_path: Path) -> None:
    from datasets import load_from_disk

    root = _dataset(tmp_path, _generated("gen-1"))
    assert main(["export", str(tmp_path / "out"), "--dataset", str(root)]) == 0
    (row,) = load_from_disk(str(tmp_path / "out")).to_list()
    assert row["input_ids"] == list(range(10)) and row["loss_mask"] == [0] * 6 + [1] * 4


@pytest.mark.parametrize("verifier", [None, "/models/SmolLM2-135M-Instruct"])
def test_export_prints_a_train_command_speculators_can_load(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                              verifier: str | None) -> None:
    """The dataset records the model's name ("m" here), which speculators cannot
    load: the printed command holds --verifier, else a placeholder it explains."""
    root = _dataset(tmp_path, _generated("gen-1"))
    assert main(["export", str(tmp_path / "out"), "--dataset", str(root), *(["--verifier", verifier] if verifier
                                                                              else [])]) == 0
    out = capsys.readouterr().out
    command = next(line for line in out.splitlines() if line.startswith("train with: ")).split()
    loaded = command[command.index("--verifier-name-or-path") + 1]
    assert loaded == (verifier or "VERIFIER")
    cpu = next(line for line in out.splitlines() if "python -m hsx.trainer.speculators_cpu" in line).split()
    flags = cpu[cpu.index("hsx.trainer.speculators_cpu") + 1:]  # the same flags, 2,048-token batches
    gpu = command[command.index("train", 2) + 1:]  # after "train with: speculators train"
    assert gpu[gpu.index("--total-seq-len") + 1] == "8192" and flags[flags.index("--total-seq-len") + 1] == "2048"
    assert [f for f in flags if f != "2048"] == [f for f in gpu if f != "8192"]
    assert ("VERIFIER: the directory or hub id of m, the model the dataset was extracted with" in out) == (
        verifier is None)


@pytest.mark.parametrize("kind", ["dflash", "peagle"])
def test_export_for_another_draft_type_prints_its_train_command(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                                 kind: str) -> None:
    root = _dataset(tmp_path, _generated("gen-1"))
    assert main(["export", str(tmp_path / "out"), "--dataset", str(root), "--speculator-type", kind]) == 0
    out = capsys.readouterr().out
    for line in ("train with: speculators train", "python -m hsx.trainer.speculators_cpu"):
        command = next(text for text in out.splitlines() if line in text).split()
        assert command[command.index("--speculator-type") + 1] == kind
    assert orjson.loads((tmp_path / "out" / "hsx_export.json").read_bytes())["speculator_type"] == kind


@pytest.mark.parametrize(("kind", "reason"), [
    ("mtp", "refused: MTP drafts are trained on the verifier's own multi-token-prediction layers"),
    ("xpress", "refused: vLLM does not serve XPress drafts"),
    ("medusa", "not a draft type speculators trains (hsx feeds eagle3, dflash, peagle)"),
])
def test_export_refuses_a_type_it_cannot_feed_with_the_reason(tmp_path: Path, capfd: pytest.CaptureFixture[str],
                                                              kind: str, reason: str) -> None:
    root = _dataset(tmp_path, _generated("gen-1"))
    assert main(["export", str(tmp_path / "out"), "--dataset", str(root), "--speculator-type", kind]) == 2
    assert f"--speculator-type {kind}: {reason}" in capfd.readouterr().err
    assert not (tmp_path / "out").exists()


def test_export_refuses_last_token_samples(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    recs, _ = records("last-1", tokens=1)
    manifest = orjson.loads(recs[-1].value)
    manifest["capture"] = "last"  # one token, so the one block already covers [T-1, T)
    recs[-1] = Record(recs[-1].offset, recs[-1].key, orjson.dumps(manifest), recs[-1].headers)
    (sample,) = feed(Assembler(), recs)
    assert isinstance(sample, Sample)
    root = _dataset(tmp_path, sample)
    assert main(["export", str(tmp_path / "out"), "--dataset", str(root)]) == 2
    assert "holds the last token's hidden states only" in capfd.readouterr().err
    assert not (tmp_path / "out").exists()


def test_inspect_into_a_closed_pipe_stops_quietly(tmp_path: Path) -> None:
    """``hsx inspect DATASET | head -1`` once ``head`` has left: the command's
    output goes to a pipe nobody reads; it exits 141 (128 + SIGPIPE) without a
    traceback. The read end is closed before the child starts, so its first write
    fails whatever the timing; buffered (a write at the end, the usual case in a
    pipe) and unbuffered (every print writes) stdout both."""
    root = _dataset(tmp_path, _generated("gen-1"))
    for unbuffered in ("", "1"):
        env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
        if unbuffered:
            env["PYTHONUNBUFFERED"] = unbuffered
        read_end, write_end = os.pipe()
        os.close(read_end)
        try:
            done = subprocess.run([sys.executable, "-m", "hsx.cli", "inspect", str(root)], stdout=write_end,
                                  stderr=subprocess.PIPE, cwd=Path(__file__).resolve().parents[2], env=env,
                                  timeout=60)
        finally:
            os.close(write_end)
        stderr = done.stderr.decode()
        assert done.returncode == ExitCode.BROKEN_PIPE == 141, (unbuffered, stderr)
        assert "Traceback" not in stderr and "Broken pipe" not in stderr, (unbuffered, stderr)
