"""bench/gpu_check.py's own logic, on the CPU at tiny sizes (the real run needs a
GPU host): its checks pass on correct code and fail on broken code, its figures
carry the ``gpu_`` prefix, and it imports without vLLM."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bench import gpu_check

ROOT = Path(__file__).resolve().parents[2]


def test_self_test_passes_with_gpu_prefixed_figures() -> None:
    figures = gpu_check.run(self_test=True)
    assert figures["gpu_gather_bit_exact"] is True and figures["gpu_fp8_bit_exact"] is True
    assert figures["gpu_cuda_gatherer_checked"] is False  # no CUDA here
    assert all(key.startswith("gpu_") for key in figures)
    assert {"gpu_codec_threads_1_encode_mb_s", "gpu_codec_threads_2_decode_mb_s", "gpu_codec_keeps_up"} <= set(figures)
    assert "keeps up with 885 MB/s" in gpu_check.report(figures)


def test_a_wrong_gather_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    real = gpu_check.gather_rows
    monkeypatch.setattr(gpu_check, "gather_rows", lambda *a, **k: torch.roll(real(*a, **k), 1, dims=-1))
    assert gpu_check.run(self_test=True)["gpu_gather_bit_exact"] is False


def test_a_wrong_fp8_rounding_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    real = gpu_check.quantize

    def off_by_one(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        codes, scales = real(rows)
        return codes ^ 1, scales  # one unit in the last place

    monkeypatch.setattr(gpu_check, "quantize", off_by_one)
    assert gpu_check.run(self_test=True)["gpu_fp8_bit_exact"] is False


def test_merge_keeps_the_other_keys(tmp_path: Path) -> None:
    results = tmp_path / "results.json"
    results.write_text(json.dumps({"codec_ratio_bf16": 1.5, "gpu_old": 1}))
    gpu_check.merge(results, {"gpu_old": 2, "gpu_new": 3})
    assert json.loads(results.read_text()) == {"codec_ratio_bf16": 1.5, "gpu_old": 2, "gpu_new": 3}


def test_imports_without_vllm() -> None:
    code = ("import sys; sys.modules['vllm'] = None\n"
            "import bench.gpu_check, hsx.extractor.connector.gather, hsx.extractor.connector.fp8\n"
            "assert sys.modules['vllm'] is None")
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, timeout=60)
