"""Codec benchmark: compression ratio and single-core speed of each codec on real
SmolLM2 hidden states (HF transformers, float32, cast to bfloat16).

    python -m bench.codec
"""

from __future__ import annotations

import json
import time

import torch

from bench.prompts import demo_token_ids
from extractor.engine import default_layer_ids
from hsx import models
from hsx.reference import HFReference
from schemas import Codec, DType
from schemas.codec import decode_block, encode_block

BLOCK_TOKENS = 256


def smollm2_hidden_states() -> torch.Tensor:
    """[tokens, layers, hidden] for the demo prompts, EAGLE-3 default layers."""
    from transformers import AutoTokenizer

    path = models.prepare(names=["smollm2-135m-instruct"])["smollm2-135m-instruct"]
    reference = HFReference(path)
    layers = default_layer_ids(reference.num_layers)
    tokenizer = AutoTokenizer.from_pretrained(path)
    return torch.cat([reference.hidden_states(ids, layers) for ids in demo_token_ids(tokenizer)])


def measure(hidden: torch.Tensor, codec: Codec, level: int = 1, repeats: int = 3) -> dict[str, float]:
    torch.set_num_threads(1)
    blocks = [hidden[i : i + BLOCK_TOKENS].contiguous() for i in range(0, hidden.shape[0], BLOCK_TOKENS)]
    raw = [b.view(torch.uint8).numpy() for b in blocks]
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        encoded = [encode_block(r, shape=tuple(b.shape), dtype=DType.BFLOAT16, token_start=0, codec=codec, level=level)
                   for r, b in zip(raw, blocks)]
        best = min(best, time.perf_counter() - start)
    start = time.perf_counter()
    for value in encoded:
        decode_block(value)
    decode_seconds = time.perf_counter() - start
    raw_bytes = sum(r.nbytes for r in raw)
    return {
        "ratio": raw_bytes / sum(len(e) for e in encoded),
        "encode_mb_s": raw_bytes / best / 1e6,
        "decode_mb_s": raw_bytes / decode_seconds / 1e6,
    }


def main() -> None:
    hidden = smollm2_hidden_states().to(torch.bfloat16)
    results = {"tokens": hidden.shape[0], "shape": list(hidden.shape)}
    for codec, level in ((Codec.BYTEPLANE_ZSTD, 1), (Codec.BYTEPLANE_ZSTD, 3), (Codec.ZSTD, 1), (Codec.ZSTD, 3), (Codec.NONE, 0)):
        results[f"{codec.value}-{level}"] = measure(hidden, codec, level)
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
