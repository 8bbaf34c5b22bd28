"""Extraction overhead, side by side in one run: the same prompts through the same
model on (a) a plain vLLM engine that only prefills and (b) the hsx engine
(extract_hidden_states + HsxConnector, codec on, records acknowledged by Kafka).
Rounds alternate between the two so that machine noise hits both alike.

    python -m bench.extraction [--model smollm2-135m-instruct] [--rounds 3] [--repeat 4]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import tempfile
import time
import uuid
from pathlib import Path

from bench.prompts import demo_token_ids
from extractor.completion import CompletionReceiver
from extractor.engine import Engine, EngineOptions, default_layer_ids, engine_args, text_config
from hsx import models
from runtime.broker import dev_bootstrap
from runtime.kafka import ensure_topics
from runtime.settings import KafkaSettings, TopicSettings
from schemas import SourceRef
from schemas.connector import ConnectorConfig, RequestParams

# Identical prompts would be served from the prefix cache on the second round.
NO_PREFIX_CACHE = {"enable_prefix_caching": False}


def unique_prompts(tokenizer, repeat: int) -> list[list[int]]:  # type: ignore[no-untyped-def]
    """The demo mix ``repeat`` times, each copy made distinct by its first token."""
    prompts = demo_token_ids(tokenizer)
    return [[100 + copy] + ids for copy in range(repeat) for ids in prompts]


async def run_plain(llm, prompts: list[list[int]]) -> float:  # type: ignore[no-untyped-def]
    from vllm import SamplingParams, TokensPrompt

    async def one(ids: list[int]) -> None:
        async for _ in llm.generate(TokensPrompt(prompt_token_ids=ids), SamplingParams(max_tokens=1),
                                    request_id=uuid.uuid4().hex):
            pass

    start = time.perf_counter()
    await asyncio.gather(*(one(ids) for ids in prompts))
    return time.perf_counter() - start


async def run_hsx(engine: Engine, completions: CompletionReceiver, prompts: list[list[int]]) -> tuple[float, int, int]:
    async def one(i: int, ids: list[int]) -> tuple[int, int]:
        params = RequestParams(request_id=f"bench-{i}", attempt_id=uuid.uuid4().hex,
                               source=SourceRef(topic="bench", partition=0, offset=i))
        future = completions.expect(params.attempt_id)
        await engine.prefill(ids, params)
        report = await future
        assert report.ok, report.error
        return report.raw_bytes, report.compressed_bytes

    start = time.perf_counter()
    sizes = await asyncio.gather(*(one(i, ids) for i, ids in enumerate(prompts)))
    return time.perf_counter() - start, sum(s[0] for s in sizes), sum(s[1] for s in sizes)


async def main_async(args: argparse.Namespace) -> dict[str, object]:
    from transformers import AutoTokenizer
    from vllm.v1.engine.async_llm import AsyncLLM

    path = models.prepare(names=[args.model])[args.model]
    tokenizer = AutoTokenizer.from_pretrained(path)
    layers = default_layer_ids(text_config(str(path)).num_hidden_layers)
    prompts = unique_prompts(tokenizer, args.repeat)
    tokens = sum(len(p) for p in prompts)
    options = EngineOptions(model=str(path), layer_ids=layers, dtype="float32", max_model_len=2048,
                            enforce_eager=True, engine_args=NO_PREFIX_CACHE)

    with dev_bootstrap() as bootstrap, tempfile.TemporaryDirectory() as tmp:
        kafka = KafkaSettings(bootstrap=bootstrap)
        topic = f"bench.blocks-{uuid.uuid4().hex[:6]}"
        ensure_topics(kafka, TopicSettings(partitions=1), [topic])
        os.environ["HSX_KAFKA_BOOTSTRAP"] = bootstrap  # the connector reads it in vLLM's processes
        completions = CompletionReceiver(Path(tmp))
        completions.start()
        connector = ConnectorConfig(completion_address=completions.address, blocks_topic=topic, model=args.model)
        hsx = Engine(options, connector)
        plain_args = engine_args(options, connector)
        plain_args.speculative_config = None
        plain_args.kv_transfer_config = None
        plain = AsyncLLM.from_engine_args(plain_args)
        try:
            await run_plain(plain, prompts[:8])  # warm-up both
            await run_hsx(hsx, completions, prompts[:8])
            plain_s, hsx_s = [], []
            raw = compressed = 0
            for _ in range(args.rounds):
                plain_s.append(await run_plain(plain, prompts))
                seconds, raw, compressed = await run_hsx(hsx, completions, prompts)
                hsx_s.append(seconds)
        finally:
            plain.shutdown()
            hsx.shutdown()
            await completions.close()
    ratios = [p / h for p, h in zip(plain_s, hsx_s)]
    return {
        "model": args.model,
        "prompts": len(prompts),
        "tokens": tokens,
        "layers": layers,
        "rounds": args.rounds,
        "plain_tokens_per_s": [round(tokens / s, 1) for s in plain_s],
        "hsx_tokens_per_s": [round(tokens / s, 1) for s in hsx_s],
        "extraction_overhead_ratio_median": round(statistics.median(ratios), 3),
        "hsx_raw_bytes": raw,
        "hsx_compressed_bytes": compressed,
        "note": "float32, enforce_eager, prefix caching off in both engines, Kafka acks awaited for hsx",
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct", choices=models.MODEL_NAMES)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repeat", type=int, default=4, help="copies of the 64 demo prompts per round")
    parser.add_argument("--out", type=Path, help="also write the results here as JSON (vLLM logs to stdout)")
    args = parser.parse_args()
    results = json.dumps(asyncio.run(main_async(args)), indent=2)
    if args.out:
        args.out.write_text(results + "\n")
    print(results)


if __name__ == "__main__":
    main()
