"""Dataset codecs benchmark: bytes per token and single-core encode/decode speed of
``raw``, ``byteplane-zstd``, ``fp8`` and ``fp8-zstd`` (:mod:`hsx.codecs.dataset`)
on real SmolLM2 hidden states (HF transformers, EAGLE-3's default layers), as
bfloat16 and as float32, one sample per prompt as the sink stores them. Two sets:

* ``demo``: the 64+ demo chats, about 27 tokens each, most of them SmolLM2's
  default system prompt;
* ``long``: three prompts of 512, 1,024 and 2,048 tokens of real text
  (``bench.prompts.prompt_of_length``), closer to a training sample.

Also: fp8's error per layer.

* byteplane-zstd samples are the 1 MiB block records the connector cuts, back to
  back, as the sink would keep them; the other codecs encode the whole sample.
* Speeds are MB of the sample's raw bytes (its own dtype) per second, best of
  ``--repeats`` passes over every sample, one thread (``torch.set_num_threads(1)``;
  zstd runs on the calling thread).
* ``fp8-zstd`` is also measured at zstd level 3 (the codec's default is 1). The
  ratio of nibble planes (sign and exponent high nibble apart from the low one,
  at level 1) is recorded to show why plain zstd was chosen.
* ``*_order0_bound_vs_raw_bf16``: raw bf16 ÷ the order-0 entropy of each sample's
  bytes (bf16's two byte planes; fp8 codes plus float32 scales). No coder that
  looks at one byte at a time (zstd's literals) gets past it. Only repeats
  (matches) or context (for example, each channel's own statistics) can.

    python -m bench.dataset_codecs [--out FILE] [--merge bench/results.json] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch
import zstandard

from bench import codec as codec_bench
from bench.stages import best
from hsx.codecs.block import encode_block
from hsx.codecs.dataset import decode_sample, encode_sample
from hsx.codecs.fp8 import error_bound, from_fp8, to_fp8, widen
from hsx.runtime.tensors import WIRE_DTYPES
from hsx.schemas import DType
from hsx.schemas.dataset_codec import DatasetCodec

Sample = tuple[bytes, tuple[int, int, int]]


def byteplane_records(raw: bytes, shape: tuple[int, int, int], dtype: DType) -> bytes:
    """A sample as the connector's 1 MiB block records, back to back."""
    row = shape[1] * shape[2] * dtype.itemsize
    per_block = max(1, codec_bench.BLOCK_BYTES // row)
    return b"".join(encode_block(raw[s * row : min(s + per_block, shape[0]) * row],
                                 shape=(min(per_block, shape[0] - s), shape[1], shape[2]), dtype=dtype, token_start=s)
                    for s in range(0, shape[0], per_block))


def measure(samples: list[Sample], dtype: DType, codec: DatasetCodec, level: int | None,
            repeats: int) -> tuple[dict[str, float], list[bytes]]:
    """Bytes per token and encode/decode MB/s of one codec over every sample."""
    def encode() -> list[bytes]:
        if codec is DatasetCodec.BYTEPLANE_ZSTD:
            return [byteplane_records(raw, shape, dtype) for raw, shape in samples]
        return [encode_sample(raw, shape=shape, dtype=dtype, codec=codec, level=level) for raw, shape in samples]

    encode_s = best(encode, repeats)
    stored = encode()
    decode_s = best(lambda: [decode_sample(v, shape=s, dtype=dtype, codec=codec)
                             for v, (_, s) in zip(stored, samples)], repeats)
    raw_bytes = sum(len(raw) for raw, _ in samples)
    tokens = sum(shape[0] for _, shape in samples)
    return {"bytes_per_token": sum(len(v) for v in stored) / tokens, "encode_mb_s": raw_bytes / encode_s / 1e6,
            "decode_mb_s": raw_bytes / decode_s / 1e6}, stored


def nibble_ratio(samples: list[Sample], dtype: DType) -> float:
    """fp8 codes ÷ their two nibble planes zstd-1-compressed per sample (the
    alternative to plain zstd)."""
    compressor = zstandard.ZstdCompressor(level=1)
    size = packed = 0
    for raw, shape in samples:
        codes = to_fp8(widen(raw, shape, dtype))[0].reshape(-1)
        codes = codes[: codes.size // 2 * 2]
        for plane in (codes >> 4, codes & 0xF):
            packed += len(compressor.compress(((plane[0::2] << 4) | plane[1::2]).astype(np.uint8).tobytes()))
        size += codes.size
    return size / packed


def entropy_bits(symbols: np.ndarray) -> float:
    """Total order-0 entropy of ``symbols`` (uint8) in bits: what any coder that
    looks at one byte at a time, as zstd's Huffman literals do, cannot beat."""
    counts = np.bincount(symbols.reshape(-1), minlength=256).astype(np.float64)
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log2(p)).sum() * symbols.size)


def order0_bounds(samples: list[Sample]) -> dict[str, float]:
    """Raw bf16 bytes ÷ the per-sample order-0 entropy of bf16's two byte planes,
    and of the fp8 codes: the best ratio a byte-wise coder can reach per sample."""
    bits = {"byteplane": 0.0, "fp8": 0.0}
    raw_bytes = 0
    for raw, shape in samples:
        planes = np.frombuffer(raw, dtype=np.uint8).reshape(-1, 2)
        bits["byteplane"] += entropy_bits(planes[:, 0]) + entropy_bits(planes[:, 1])
        bits["fp8"] += entropy_bits(to_fp8(widen(raw, shape, DType.BFLOAT16))[0]) + shape[0] * shape[1] * 32
        raw_bytes += len(raw)
    return {name: raw_bytes * 8 / value for name, value in bits.items()}


def fp8_errors(hidden: torch.Tensor, prefix: str) -> dict[str, object]:
    """Relative error per layer (‖x' - x‖ / ‖x‖ over tokens and hidden), the worst
    relative error of an element that is normal after scaling, and the bound check."""
    x = hidden.float().numpy()
    codes, scales = to_fp8(x)
    back = from_fp8(codes, scales)
    err = np.abs(back - x)
    normal = np.abs(x) >= scales[..., None] * 2.0**-6
    out: dict[str, object] = {
        f"{prefix}_fp8_within_bound": bool((err <= error_bound(x, scales)).all()),
        f"{prefix}_fp8_max_rel_error_normal": round(float((err[normal] / np.abs(x[normal])).max()), 5),
    }
    per_layer = np.linalg.norm(back - x, axis=(0, 2)) / np.linalg.norm(x, axis=(0, 2))
    for i, value in enumerate(per_layer):
        out[f"{prefix}_fp8_rel_error_layer_{i}"] = round(float(value), 5)
    return out


def long_samples() -> list[torch.Tensor]:
    """SmolLM2's float32 hidden states of three long prompts of real text."""
    from transformers import AutoTokenizer

    from bench.prompts import prompt_of_length
    from hsx import models
    from hsx.extractor.engine import default_layer_ids
    from hsx.reference import HFReference

    path = models.prepare(names=["smollm2-135m-instruct"])["smollm2-135m-instruct"]
    reference = HFReference(path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    layers = default_layer_ids(reference.num_layers)
    return [reference.hidden_states(prompt_of_length(tokenizer, n, salt=i), layers)
            for i, n in enumerate(LONG_LENGTHS)]


LONG_LENGTHS = [512, 1024, 2048]


def set_figures(set_name: str, samples_f32: list[torch.Tensor], repeats: int) -> dict[str, object]:
    """Every codec on one set of samples, as bf16 and as float32."""
    hidden_f32 = torch.cat(samples_f32)
    tokens = hidden_f32.shape[0]
    raw_bf16_per_token = hidden_f32.shape[1] * hidden_f32.shape[2] * 2
    prefix = f"dataset_{set_name}"
    out: dict[str, object] = {f"{prefix}_samples": len(samples_f32), f"{prefix}_tokens": tokens,
                              f"{prefix}_shape": list(hidden_f32.shape[1:])}
    for name, torch_dtype in (("bf16", torch.bfloat16), ("f32", torch.float32)):
        dtype = WIRE_DTYPES[torch_dtype]
        samples = [(s.to(torch_dtype).contiguous().view(torch.uint8).numpy().tobytes(), tuple(s.shape))
                   for s in samples_f32]
        variants = [(c, None, c.value) for c in DatasetCodec] + [(DatasetCodec.FP8_ZSTD, 3, "fp8-zstd-3")]
        for codec, level, label in variants:
            figures, _ = measure(samples, dtype, codec, level, repeats)
            for key, value in figures.items():
                if codec is not DatasetCodec.RAW or key == "bytes_per_token":  # raw does no work to time
                    out[f"{prefix}_{name}_{label}_{key}"] = round(value, 1)
            out[f"{prefix}_{name}_{label}_vs_raw_bf16"] = round(raw_bf16_per_token / figures["bytes_per_token"], 3)
        out[f"{prefix}_{name}_fp8_nibble-zstd-1_codes_ratio"] = round(nibble_ratio(samples, dtype), 3)
        out.update(fp8_errors(hidden_f32.to(torch_dtype), f"{prefix}_{name}"))
        if dtype is DType.BFLOAT16:
            for key, value in order0_bounds(samples).items():
                out[f"{prefix}_bf16_{key}_order0_bound_vs_raw_bf16"] = round(value, 3)
    return out


def results(repeats: int = 3) -> dict[str, object]:
    """Flat ``dataset_*`` figures, with the refreshed ``codec_*`` table beside them."""
    torch.set_num_threads(1)
    demo = codec_bench.smollm2_samples()
    long = long_samples()
    out = {**set_figures("demo", demo, repeats), **set_figures("long", long, repeats)}
    # The targets, on the long set (training-sized samples of real text).
    out["dataset_byteplane_zstd_vs_raw_bf16"] = out["dataset_long_bf16_byteplane-zstd_vs_raw_bf16"]
    out["dataset_fp8_zstd_vs_raw_bf16"] = out["dataset_long_bf16_fp8-zstd_vs_raw_bf16"]
    out["dataset_byteplane_zstd_decode_mb_s"] = out["dataset_long_bf16_byteplane-zstd_decode_mb_s"]
    out.update(codec_bench.results(demo))
    return out


def merge(path: Path, figures: dict[str, object]) -> None:
    """Add the figures to a results file, re-read just before writing (other
    sections write there too), with the targets recomputed."""
    from bench import report

    current = json.loads(path.read_text()) if path.exists() else {}
    current.update(figures)
    current.update(report.targets(current))
    path.write_text(json.dumps(current, indent=2) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--merge", type=Path, help="add the figures to this results file (e.g. bench/results.json)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="one pass each (the figures are then noisier)")
    args = parser.parse_args()
    figures = results(repeats=1 if args.quick else args.repeats)
    text = json.dumps(figures, indent=2)
    if args.out:
        args.out.write_text(text + "\n")
    if args.merge:
        merge(args.merge, figures)
    print(text)


if __name__ == "__main__":
    main()
