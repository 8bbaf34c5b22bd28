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


def test_the_pinned_pool_hands_out_the_smallest_fitting_buffer() -> None:
    # Found by gpu_check on an H200: the pool removed a buffer with list.remove,
    # which compares tensors element by element and fails on buffers of other sizes.
    from hsx.extractor.connector.gather import PinnedPool

    pool = PinnedPool(torch.uint8)
    small, large, larger = torch.empty(8, dtype=torch.uint8), torch.empty(64, dtype=torch.uint8), \
        torch.empty(128, dtype=torch.uint8)
    for buffer in (small, larger, large):
        pool.give_back(buffer)
    assert pool.take(40) is large
    assert pool.take(40) is larger
    assert pool.take(8) is small
