"""Engines side by side in one process, rounds interleaved (the order rotates every
round so that machine noise and warm caches hit every side alike):

* ``plain``: vLLM prefill only, no extraction, async scheduling off (as in the
  two extraction engines: vLLM turns it off for ``extract_hidden_states``);
* ``plain_async``: the same with vLLM's default (async scheduling on);
* ``hsx``: extract_hidden_states + HsxConnector, codec on, Kafka acks awaited;
* ``files``: extract_hidden_states + vLLM's stock one-safetensors-file-per-request
  connector (``bench.files_connector``), files written awaited;
* ``hsx_files``: the same file per request from HsxConnector (the seed's server
  contract, ``shared_storage_path`` alone), files written awaited;
* ``hf``: HF transformers ``output_hidden_states=True``, one prompt per forward.

Then prefill latency vs prompt length (one prompt alone) on ``plain`` and ``hsx``.

    python -m bench.extraction [--quick] [--out F]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import statistics
import tempfile
import time
import uuid
from pathlib import Path

from bench.files_connector import wait_written
from bench import section
from bench.prompts import prompt_of_length, workload
from hsx.extractor.completion import CompletionReceiver
from hsx.extractor.connector.kafka_settings import write_kafka_settings
from hsx.extractor.engine import Engine, EngineOptions, default_layer_ids, engine_args
from hsx.extractor.model_config import text_config
from hsx import models
from hsx.local.broker import dev_bootstrap
from hsx.local.topics import fresh_topic_settings
from hsx.runtime.kafka import ensure_topics
from hsx.runtime.settings import KafkaSettings
from hsx.schemas import SourceRef
from hsx.schemas.connector import ConnectorConfig, RequestParams, request_bytes_bound

MODEL = "smollm2-135m-instruct"
VLLM_PROCESSES = {"distributed_executor_backend": "mp"}
"""The plain engines are vLLM's own (on CPU: a Worker process beside the engine core),
so the hsx engine compared with them keeps that layout too, not hsx's CPU default of
the worker inside the engine core (``extractor/cpu_defaults.py``)."""
# Identical prompts would be served from the prefix cache on the second round.
NO_PREFIX_CACHE = {"enable_prefix_caching": False, **VLLM_PROCESSES}
LONG = [256, 384, 512, 768, 1024, 1536]
LENGTHS = [256, 512, 1024, 2048, 4096]


def omp_threads() -> int:
    """OpenMP threads of a vLLM CPU worker: the cores VLLM_CPU_OMP_THREADS_BIND names."""
    from vllm.utils.cpu_resource_utils import parse_id_list

    bind = os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "")
    return len(parse_id_list(bind)) if bind and bind not in ("auto", "nobind") else 0


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


async def run_files(llm, prompts: list[list[int]]) -> tuple[float, int]:  # type: ignore[no-untyped-def]
    """Until every request's file is written (its lock released), as vLLM's reader waits."""
    from vllm import SamplingParams, TokensPrompt

    async def one(ids: list[int]) -> str:
        last = None
        async for out in llm.generate(TokensPrompt(prompt_token_ids=ids), SamplingParams(max_tokens=1),
                                      request_id=uuid.uuid4().hex):
            last = out
        path = last.kv_transfer_params["hidden_states_path"]
        await asyncio.to_thread(wait_written, path)
        return path

    start = time.perf_counter()
    paths = await asyncio.gather(*(one(ids) for ids in prompts))
    seconds = time.perf_counter() - start
    stored = sum(os.path.getsize(p) for p in paths)
    for p in paths:
        os.remove(p)
        os.remove(p + ".lock")
    return seconds, stored


def run_hf(reference, prompts: list[list[int]], layers: list[int]) -> float:  # type: ignore[no-untyped-def]
    start = time.perf_counter()
    for ids in prompts:
        reference.hidden_states(ids, layers).contiguous()
    return time.perf_counter() - start


async def main_async(args: argparse.Namespace) -> dict[str, object]:
    import torch
    from transformers import AutoTokenizer
    from vllm.config import KVTransferConfig
    from vllm.v1.engine.async_llm import AsyncLLM

    from hsx.reference import HFReference

    path = models.prepare(names=[MODEL])[MODEL]
    tokenizer = AutoTokenizer.from_pretrained(path)
    model_config = text_config(str(path))
    layers = default_layer_ids(model_config.num_hidden_layers)
    prompts = workload(tokenizer, LONG[:1] if args.quick else LONG)
    lengths = LENGTHS[:2] if args.quick else LENGTHS
    rounds = 1 if args.quick else args.rounds
    tokens = sum(len(p) for p in prompts)
    options = EngineOptions(model=str(path), layer_ids=layers, dtype="float32", max_model_len=max(LENGTHS) + 512,
                            enforce_eager=True, engine_args=NO_PREFIX_CACHE)
    threads = omp_threads() or os.cpu_count() or 1
    torch.set_num_threads(threads)  # HF gets as many threads as a vLLM worker

    results: dict[str, object] = {}
    with dev_bootstrap() as bootstrap, tempfile.TemporaryDirectory() as tmp:
        kafka = KafkaSettings(bootstrap=bootstrap)
        topic_settings = fresh_topic_settings("bench.", partitions=1)
        topic = topic_settings.blocks
        ensure_topics(kafka, topic_settings, [topic])
        completions = CompletionReceiver(Path(tmp))
        completions.start()
        connector = ConnectorConfig(
            completion_address=completions.address, kafka_settings_file=write_kafka_settings(kafka, Path(tmp)),
            blocks_topic=topic, model=MODEL,
            max_request_bytes=request_bytes_bound(options.max_model_len, len(layers), model_config.hidden_size))
        storage = Path(tmp) / "files"

        def plain_args(async_scheduling: bool):  # type: ignore[no-untyped-def]
            a = engine_args(options, connector)
            a.speculative_config = None
            a.kv_transfer_config = None
            a.async_scheduling = async_scheduling
            return a

        def files_args(connector_class: str, module: str):  # type: ignore[no-untyped-def]
            a = engine_args(options, connector)
            a.kv_transfer_config = KVTransferConfig(
                kv_connector=connector_class, kv_connector_module_path=module, kv_role="kv_producer",
                kv_connector_extra_config={"shared_storage_path": str(storage / connector_class)})
            return a

        hsx = Engine(options, connector)
        plain = AsyncLLM.from_engine_args(plain_args(False))
        files = AsyncLLM.from_engine_args(files_args("CpuHiddenStatesFileConnector", "bench.files_connector"))
        hsx_files = AsyncLLM.from_engine_args(files_args("HsxConnector", "hsx.extractor.connector"))
        plain_async = None if args.quick else AsyncLLM.from_engine_args(plain_args(True))
        reference = HFReference(path)
        raw = compressed = stored = 0

        async def side(name: str, batch: list[list[int]]) -> float:
            nonlocal raw, compressed, stored
            if name == "plain":
                return await run_plain(plain, batch)
            if name == "plain_async":
                return await run_plain(plain_async, batch)
            if name == "hsx":
                seconds, raw, compressed = await run_hsx(hsx, completions, batch)
                return seconds
            if name in ("files", "hsx_files"):
                seconds, stored = await run_files(files if name == "files" else hsx_files, batch)
                return seconds
            return run_hf(reference, batch, layers)

        sides = ["plain", "hsx", "files", "hsx_files", "hf"] + ([] if plain_async is None else ["plain_async"])
        seconds: dict[str, list[float]] = {s: [] for s in sides}
        try:
            for name in sides:  # warm-up
                await side(name, prompts[:8])
            for r in range(rounds):
                order = sides[r % len(sides):] + sides[: r % len(sides)]
                for name in order:
                    seconds[name].append(await side(name, prompts))
                    print(f"[bench.extraction] round {r} {name}: {tokens / seconds[name][-1]:.0f} tokens/s", flush=True)
            # Cost vs prompt length, one prompt alone (best of two).
            scaling: dict[int, dict[str, float]] = {}
            for n in lengths:
                prompt = [prompt_of_length(tokenizer, n, salt=7)]
                scaling[n] = {
                    "plain": min([await run_plain(plain, prompt) for _ in range(2)]),
                    "hsx": min([(await run_hsx(hsx, completions, prompt))[0] for _ in range(2)]),
                }
                print(f"[bench.extraction] {n} tokens: {scaling[n]}", flush=True)
        finally:
            for engine in (plain, files, hsx_files, plain_async, hsx):
                if engine is not None:
                    engine.shutdown()
            await completions.close()
            shutil.rmtree(storage, ignore_errors=True)

    def ratio(a: str, b: str) -> float:
        """median over rounds of (tokens/s of a) / (tokens/s of b)"""
        return round(statistics.median(sb / sa for sa, sb in zip(seconds[a], seconds[b])), 3)

    tps = {s: [round(tokens / x, 1) for x in seconds[s]] for s in sides}
    results.update({
        "model": MODEL,
        "dtype": "float32",
        "layers": layers,
        "workload_prompts": len(prompts),
        "workload_tokens": tokens,
        "rounds": rounds,
        "vllm_omp_threads": threads,
        "hf_torch_threads": torch.get_num_threads(),
        "extraction_overhead_ratio": ratio("hsx", "plain"),
        "vs_hf_ratio": ratio("hsx", "hf"),
        "vs_stock_files_ratio": ratio("hsx_files", "files"),
        "kafka_vs_stock_files_ratio": ratio("hsx", "files"),
        "stock_files_overhead_ratio": ratio("files", "plain"),
        "hsx_kafka_bytes": compressed,
        "hsx_raw_bytes": raw,
        "stock_files_bytes": stored,
    })
    if plain_async is not None:
        results["plain_async_vs_plain_ratio"] = ratio("plain_async", "plain")
        results["extraction_overhead_ratio_vs_async_default"] = ratio("hsx", "plain_async")
    for s in sides:
        results[f"{s}_tokens_per_s"] = round(statistics.median(tps[s]), 1)
        results[f"{s}_tokens_per_s_rounds"] = tps[s]
    for n, t in scaling.items():
        results[f"length_{n}_prefill_s"] = round(t["plain"], 3)
        results[f"length_{n}_hsx_s"] = round(t["hsx"], 3)
    return results


def main() -> None:
    args = section.parser(__doc__).parse_args()
    section.emit(asyncio.run(main_async(args)), args.out)


if __name__ == "__main__":
    main()
