"""The codec figures and the per-stage cost of one request vs its length, measured
on hsx's own functions with real SmolLM2 hidden states (float32, as the CPU
engine produces them; the demo prompts' states repeated to the length):

* ``gather``: :func:`hsx.extractor.connector.gather.gather_cpu` out of a paged cache of
  SmolLM2's shape (blocks in shuffled order, as a busy cache hands them out);
* ``codec``: :func:`hsx.codecs.block.encode_block` of every 1 MiB block, one thread;
* ``sink_decode``: :func:`hsx.codecs.block.decode_block` of those records (checksums
  included), what the sink does per record;
* ``sink_write``: :func:`hsx.dataset.shards.write_shard` of one sample (safetensors,
  fsync, rename, index) to a local directory.

Prefill vs length is measured on the engines (``bench.extraction``).

    python -m bench.stages [--quick]
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path

import torch

from bench import codec as codec_bench
from hsx.codecs.block import decode_block, encode_block, read_header
from hsx.dataset.sample import Sample
from hsx.dataset.shards import OpenShard, write_shard
from hsx.dataset.storage import LocalStorage
from hsx.extractor.connector.gather import gather_cpu
from hsx.schemas import Codec, DType, Manifest, SourceRef
from hsx.schemas.manifest import BlockRef

LENGTHS = [256, 512, 1024, 2048, 4096]
BLOCK_SIZE = 128  # tokens per paged-cache block on vLLM's CPU backend


def best(fn, repeats: int = 3) -> float:  # type: ignore[no-untyped-def]
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def stage_times(hidden: torch.Tensor, length: int, directory: Path) -> dict[str, float]:
    tokens = hidden[torch.arange(length) % hidden.shape[0]].contiguous()  # [T, L, H]
    _, layers, width = tokens.shape
    num_blocks = (length + BLOCK_SIZE - 1) // BLOCK_SIZE
    cache = torch.zeros(num_blocks * 4, layers, BLOCK_SIZE, width)
    block_ids = random.Random(length).sample(range(cache.shape[0]), num_blocks)
    for i, b in enumerate(block_ids):
        part = tokens[i * BLOCK_SIZE : (i + 1) * BLOCK_SIZE]
        cache[b, :, : part.shape[0]] = part.transpose(0, 1)
    assert torch.equal(gather_cpu(cache, block_ids, length, BLOCK_SIZE).tensor, tokens)
    gather_s = best(lambda: gather_cpu(cache, block_ids, length, BLOCK_SIZE))

    per_block = codec_bench.block_tokens(tokens)
    raw = tokens.view(torch.uint8).numpy().reshape(-1)
    row = raw.nbytes // length

    def encode() -> list[bytes]:
        return [encode_block(raw[s * row : min(s + per_block, length) * row], shape=(min(per_block, length - s), layers,
                             width), dtype=DType.FLOAT32, token_start=s) for s in range(0, length, per_block)]

    codec_s = best(encode)
    records = encode()
    decode_s = best(lambda: [decode_block(r) for r in records])

    blocks = []
    for i, r in enumerate(records):
        header, _ = read_header(r)
        blocks.append(BlockRef(index=i, token_start=header.token_start, token_end=header.token_end,
                               checksum=header.checksum, compressed_nbytes=len(r)))
    manifest = Manifest(request_id=f"len-{length}", attempt_id="a" * 32, model="smollm2-135m-instruct",
                        layer_ids=[2, 15, 27, 30], dtype=DType.FLOAT32, hidden_size=width, num_tokens=length,
                        token_ids=list(range(length)), codec=Codec.BYTEPLANE_ZSTD, blocks=blocks,
                        source=SourceRef(topic="bench", partition=0, offset=0))
    storage = LocalStorage(directory)
    shard = OpenShard(topic="bench", partition=0)
    shard.add(Sample(manifest, raw.tobytes(), [0]))
    write_s = best(lambda: write_shard(storage, "bench", shard))
    return {"gather": gather_s, "codec": codec_s, "sink_decode": decode_s, "sink_write": write_s}


def results(quick: bool = False) -> dict[str, object]:
    torch.set_num_threads(1)
    samples = codec_bench.smollm2_samples()
    hidden = torch.cat(samples)
    out = codec_bench.results(samples)
    with tempfile.TemporaryDirectory() as tmp:
        for length in LENGTHS[:2] if quick else LENGTHS:
            for stage, seconds in stage_times(hidden, length, Path(tmp)).items():
                out[f"length_{length}_{stage}_s"] = round(seconds, 4)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    text = json.dumps(results(args.quick), indent=2)
    if args.out:
        args.out.write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
