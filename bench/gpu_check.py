"""The connector's CUDA path on a bare GPU host: torch and CUDA, no vLLM.

vLLM cannot run on the lent GPU machine, so this checks hsx's own torch-only code:

1. **Bit for bit.** A paged cache laid out as vLLM's extract_hidden_states cache
   (``[num_blocks, num_layers, block_size, hidden]``, see
   :mod:`hsx.extractor.connector.gather`) is filled with known bf16 values. Random block
   tables and lengths from 1 to 8k tokens are then gathered. ``CudaGatherer`` (side
   stream, pinned pool, event) must equal :func:`gather_cpu` on a CPU copy. Its fp8
   path (quantize on the device, then copy) must equal :func:`hsx.codecs.fp8.to_fp8`,
   numpy's quantizer, on those rows.
2. **Gather + device-to-host GB/s** into the pinned pool, bf16 and fp8.
3. **The codec on threads.** ``encode_block``/``decode_block`` on 1, 4, 8 and 16
   threads over 2 GiB of bf16 rows, against the rate the CPU must keep up with:
   885 MB/s (27k tokens/s × 4 layers × 4096 × 2 bytes, an H200 prefilling
   Qwen3-8B as SpecForge measured). The rows are synthetic, with a few outlier
   channels, because no model weights travel to the GPU host; their ratio is not
   SmolLM2's.

Figures are flat JSON keys with a ``gpu_`` prefix. ``--merge bench/results.json``
adds them to the results file, re-read just before writing. ``--self-test`` runs
the same logic at tiny sizes on the CPU: ``CudaGatherer`` is skipped there, and
the device-side functions it calls (``gather_rows``, ``quantize``) are checked
instead. ``make test`` runs it through ``tests/unit/test_gpu_check.py``.

    python -m bench.gpu_check [--self-test] [--out FILE] [--merge bench/results.json]

The GPU host has no zstandard, pydantic, orjson or isal. Carry their wheels as
/work/.library/device/README.md describes: zstandard, pydantic, pydantic-core,
annotated-types, typing-inspection, orjson and isal, for Python 3.12.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

from hsx.codecs.block import decode_block, encode_block
from hsx.codecs.fp8 import to_fp8
from hsx.extractor.connector.fp8 import quantize
from hsx.extractor.connector.gather import CudaGatherer, gather_cpu, gather_rows
from hsx.schemas import DType

TARGET_MB_S = 27_000 * 4 * 4096 * 2 / 1e6  # 884.7
BLOCK_BYTES = 1 << 20  # the extractor's default --block-bytes


class Sizes:
    """The cache and workload; ``tiny()`` for the CPU self-test."""

    def __init__(self, layers: int = 4, hidden: int = 4096, block_size: int = 16, max_tokens: int = 8192,
                 cases: int = 16, codec_bytes: int = 2 << 30, threads: tuple[int, ...] = (1, 4, 8, 16)) -> None:
        self.layers, self.hidden, self.block_size, self.max_tokens = layers, hidden, block_size, max_tokens
        self.cases, self.codec_bytes, self.threads = cases, codec_bytes, threads
        blocks_per_request = -(-max_tokens // block_size)
        self.num_blocks = blocks_per_request * 2  # room to scatter a request's blocks over the cache

    @classmethod
    def tiny(cls) -> Sizes:
        return cls(layers=2, hidden=64, block_size=4, max_tokens=40, cases=12, codec_bytes=4 << 20, threads=(1, 2))


def known_cache(sizes: Sizes, device: torch.device, seed: int = 0) -> torch.Tensor:
    """bf16 values from a seeded generator, with outlier channels as hidden states
    have, made on the CPU so the same values are known on both sides."""
    gen = torch.Generator().manual_seed(seed)
    cache = torch.randn(sizes.num_blocks, sizes.layers, sizes.block_size, sizes.hidden, generator=gen)
    cache[..., :: max(1, sizes.hidden // 8)] *= 200.0
    return cache.to(torch.bfloat16).to(device)


def cases(sizes: Sizes, seed: int = 1) -> list[tuple[list[int], int, int]]:
    """(block_ids, num_tokens, first) for random lengths in [1, max_tokens], the
    edges included; a few capture only the last token."""
    rng = random.Random(seed)
    lengths = [1, sizes.block_size, sizes.block_size + 1, sizes.max_tokens]
    lengths += [rng.randint(1, sizes.max_tokens) for _ in range(max(0, sizes.cases - len(lengths)))]
    out = []
    for i, length in enumerate(lengths):
        block_ids = rng.sample(range(sizes.num_blocks), -(-length // sizes.block_size))
        out.append((block_ids, length, length - 1 if i % 5 == 4 else 0))
    return out


def check_bit_exact(sizes: Sizes, device: torch.device) -> dict[str, object]:
    """Every case on the device path against gather_cpu and numpy's fp8."""
    cache = known_cache(sizes, device)
    host_cache = cache.cpu()
    gatherer = CudaGatherer(cache) if device.type == "cuda" else None
    gather_ok = fp8_ok = True
    for block_ids, length, first in cases(sizes):
        expected = gather_cpu(host_cache, block_ids, length, sizes.block_size, first).tensor
        codes_ref, scales_ref = to_fp8(expected.float().numpy())
        if gatherer is not None:
            got = gatherer.gather(cache, block_ids, length, sizes.block_size, first)
            rows = got.wait().clone()
            got.release()  # type: ignore[misc]
            fp8 = gatherer.gather(cache, block_ids, length, sizes.block_size, first, fp8=True)
            codes, scales = fp8.wait().clone(), fp8.scales.clone()  # type: ignore[union-attr]
            fp8.release()  # type: ignore[misc]
        else:  # the functions CudaGatherer runs on the device, here on the CPU
            rows = gather_rows(cache, block_ids, length, sizes.block_size, first)
            codes, scales = quantize(rows)
        gather_ok &= torch.equal(rows.view(torch.int16), expected.view(torch.int16))
        fp8_ok &= np.array_equal(codes.cpu().numpy(), codes_ref) and np.array_equal(scales.cpu().numpy(), scales_ref)
    return {"gpu_check_cases": sizes.cases, "gpu_gather_bit_exact": gather_ok, "gpu_fp8_bit_exact": fp8_ok,
            "gpu_cuda_gatherer_checked": gatherer is not None}


def gather_speed(sizes: Sizes, device: torch.device, repeats: int = 10) -> dict[str, object]:
    """Gather + device-to-host GB/s of the longest request into the pinned pool
    (bytes that land on the host ÷ time until the event), bf16 and fp8."""
    if device.type != "cuda":
        return {}
    cache = known_cache(sizes, device)
    gatherer = CudaGatherer(cache)
    block_ids = random.Random(2).sample(range(sizes.num_blocks), -(-sizes.max_tokens // sizes.block_size))
    out: dict[str, object] = {}
    for fp8 in (False, True):
        best = float("inf")
        for i in range(repeats + 1):  # the first call allocates the pinned buffers
            torch.cuda.synchronize()
            start = time.perf_counter()
            got = gatherer.gather(cache, block_ids, sizes.max_tokens, sizes.block_size, fp8=fp8)
            got.wait()
            if i:
                best = min(best, time.perf_counter() - start)
            landed = got.tensor.nbytes + (got.scales.nbytes if got.scales is not None else 0)
            got.release()  # type: ignore[misc]
        out[f"gpu_gather_d2h_{'fp8' if fp8 else 'bf16'}_gb_s"] = round(landed / best / 1e9, 2)
        out[f"gpu_gather_d2h_{'fp8' if fp8 else 'bf16'}_tokens_per_s"] = round(sizes.max_tokens / best)
    return out


def codec_rows(sizes: Sizes, device: torch.device) -> list[np.ndarray]:
    """``codec_bytes`` of bf16 rows cut into 1 MiB blocks (raw bytes, uint8)."""
    row_bytes = sizes.layers * sizes.hidden * 2
    tokens = max(1, sizes.codec_bytes // row_bytes)
    gen_device = device if device.type == "cuda" else torch.device("cpu")
    rows = torch.randn(tokens, sizes.layers, sizes.hidden, device=gen_device,
                       generator=torch.Generator(device=gen_device).manual_seed(3))
    rows[..., :: max(1, sizes.hidden // 8)] *= 200.0
    raw = rows.to(torch.bfloat16).cpu().view(torch.uint8).numpy().reshape(tokens, row_bytes)
    per_block = max(1, BLOCK_BYTES // row_bytes)
    return [raw[i : i + per_block] for i in range(0, tokens, per_block)]


def codec_threads(sizes: Sizes, device: torch.device) -> dict[str, object]:
    """Encode and decode MB/s of the rows on each thread count (one pass each; the
    data is far larger than any cache)."""
    blocks = codec_rows(sizes, device)
    shape = (sizes.layers, sizes.hidden)

    def encode(block: np.ndarray) -> bytes:
        return encode_block(block, shape=(block.shape[0], *shape), dtype=DType.BFLOAT16, token_start=0)

    total = sum(b.nbytes for b in blocks)
    out: dict[str, object] = {"gpu_codec_bytes": total, "gpu_codec_target_mb_s": round(TARGET_MB_S, 1)}
    for threads in sizes.threads:
        with ThreadPoolExecutor(threads) as pool:
            start = time.perf_counter()
            records = list(pool.map(encode, blocks))
            encode_s = time.perf_counter() - start
            start = time.perf_counter()
            for _ in pool.map(decode_block, records):
                pass
            decode_s = time.perf_counter() - start
        out[f"gpu_codec_threads_{threads}_encode_mb_s"] = round(total / encode_s / 1e6, 1)
        out[f"gpu_codec_threads_{threads}_decode_mb_s"] = round(total / decode_s / 1e6, 1)
        out["gpu_codec_ratio"] = round(total / sum(len(r) for r in records), 3)
        del records
    keeping_up = [t for t in sizes.threads if out[f"gpu_codec_threads_{t}_encode_mb_s"] >= TARGET_MB_S]  # type: ignore[operator]
    out["gpu_codec_keeps_up"] = bool(keeping_up)
    out["gpu_codec_threads_to_keep_up"] = min(keeping_up) if keeping_up else None
    return out


def run(self_test: bool = False) -> dict[str, object]:
    """All three parts; on the CPU when ``self_test`` (or when there is no CUDA)."""
    cuda = torch.cuda.is_available() and not self_test
    device = torch.device("cuda" if cuda else "cpu")
    sizes = Sizes.tiny() if self_test else Sizes()
    out: dict[str, object] = {"gpu_self_test": self_test, "gpu_torch": torch.__version__,
                              "gpu_device": torch.cuda.get_device_name() if cuda else "cpu"}
    out.update(check_bit_exact(sizes, device))
    out.update(gather_speed(sizes, device))
    out.update(codec_threads(sizes, device))
    return out


def report(figures: dict[str, object]) -> str:
    """The verdicts in a few lines."""
    threads = figures.get("gpu_codec_threads_to_keep_up")
    lines = [
        f"device: {figures['gpu_device']} (torch {figures['gpu_torch']})",
        f"gather bit-exact vs gather_cpu: {figures['gpu_gather_bit_exact']}; fp8 bit-exact vs hsx.codecs.fp8: "
        f"{figures['gpu_fp8_bit_exact']} ({figures['gpu_check_cases']} cases; CudaGatherer "
        f"{'checked' if figures['gpu_cuda_gatherer_checked'] else 'skipped: no CUDA'})",
        f"codec encode keeps up with {TARGET_MB_S:.0f} MB/s: "
        + (f"yes, from {threads} thread(s)" if threads else "no, on none of the thread counts tried"),
    ]
    return "\n".join(lines)


def merge(path: Path, figures: dict[str, object]) -> None:
    """Add the figures to a results file, re-read just before writing (other
    sections write there too)."""
    results = json.loads(path.read_text()) if path.exists() else {}
    results.update(figures)
    path.write_text(json.dumps(results, indent=2) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--self-test", action="store_true", help="tiny sizes on the CPU: checks this script's logic")
    parser.add_argument("--out", type=Path, help="write the figures here as JSON")
    parser.add_argument("--merge", type=Path, help="add the figures to this results file (e.g. bench/results.json)")
    args = parser.parse_args()
    figures = run(args.self_test)
    print(json.dumps(figures, indent=2))
    print(report(figures))
    if args.out:
        args.out.write_text(json.dumps(figures, indent=2) + "\n")
    if args.merge:
        merge(args.merge, figures)
    if not (figures["gpu_gather_bit_exact"] and figures["gpu_fp8_bit_exact"]):
        sys.exit(1)


if __name__ == "__main__":
    main()
