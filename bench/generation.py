"""Generate-and-capture in one pass against the two-pass way the field uses, on
the same prompts, rounds interleaved in one process (the order rotates each round):

* ``one_pass``: the hsx engine generates the answer and captures prompt + answer
  (``extract_hidden_states`` + HsxConnector, Kafka acks awaited);
* ``two_pass_cold``: plain vLLM generates, then the hsx engine prefills prompt +
  answer with ``max_tokens=1`` on a cache that has never seen them (the answers
  come from another engine, as from an HTTP server);
* ``two_pass_warm``: the hsx engine generates (nothing captured), then prefills
  prompt + answer on the same engine, whose prefix cache holds most of it;
* ``plain``: plain vLLM generation, no extraction;
* ``spec_only``: ``extract_hidden_states`` without a connector: the cost of the
  extraction method alone (each decode step runs two query tokens, the sampled
  one placed in the draft slot, and writes the draft's hidden-state cache), so
  ``one_pass`` vs ``plain`` splits into method and connector.

Every engine has the same settings (float32, eager, async scheduling off as vLLM
forces it for ``extract_hidden_states``, prefix caching on); each round's prompts
are new (salted), so no round finds another's prefixes. Greedy decoding with
``ignore_eos``: every side generates the same number of tokens. Throughput is
tokens captured per second, i.e. prompt + answer - 1 per request, on every side.

Then (unless ``--no-profile``) one more batch per engine runs under vLLM's torch profiler
and the model runner's phases (forward, sample, draft, ...) are summed from the
traces: where ``one_pass`` and ``plain`` differ, phase by phase.

    python -m bench.generation [--quick] [--rounds N] [--no-profile] [--out F]
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import glob
import gzip
import json
import os
import re
import statistics
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from bench.extraction import VLLM_PROCESSES, omp_threads
from bench import section
from bench.prompts import demo_token_ids
from hsx.extractor.completion import CompletionReceiver
from hsx.extractor.connector.kafka_settings import write_kafka_settings
from hsx.extractor.engine import Engine, EngineOptions, default_layer_ids, engine_args
from hsx.extractor.model_config import text_config
from hsx import models
from hsx.local.broker import dev_bootstrap
from hsx.local.topics import fresh_topic_settings
from hsx.runtime.kafka import ensure_topics
from hsx.runtime.settings import KafkaSettings
from hsx.schemas import Generation, SourceRef
from hsx.schemas.connector import ConnectorConfig, RequestParams, request_bytes_bound

MODEL = "smollm2-135m-instruct"
SIDES = ["one_pass", "two_pass_cold", "two_pass_warm", "plain", "spec_only"]


def prompts_of_round(tokenizer: Any, round_: int, count: int) -> list[list[int]]:
    """The demo prompts with a first token distinct per round (cold prefixes)."""
    return [[200 + round_] + ids for ids in demo_token_ids(tokenizer)[:count]]


async def generate(llm: Any, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """Plain vLLM generation; returns each answer's token ids."""
    from vllm import SamplingParams, TokensPrompt

    sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)

    async def one(ids: list[int]) -> list[int]:
        final = None
        async for final in llm.generate(TokensPrompt(prompt_token_ids=ids), sampling, request_id=uuid.uuid4().hex):
            pass
        assert final is not None
        return list(final.outputs[0].token_ids)

    return list(await asyncio.gather(*(one(ids) for ids in prompts)))


async def capture(engine: Engine, completions: CompletionReceiver, prompts: list[list[int]],
                  generation: Generation | None) -> None:
    """hsx requests, each until its records are acknowledged by Kafka: prefills
    (``generation`` None) or generate-and-capture."""

    async def one(i: int, ids: list[int]) -> None:
        params = RequestParams(request_id=f"bench-{i}", attempt_id=uuid.uuid4().hex,
                               source=SourceRef(topic="bench", partition=0, offset=i), generation=generation)
        future = completions.expect(params.attempt_id)
        await engine.prefill(ids, params)
        report = await future
        assert report.ok, report.error

    await asyncio.gather(*(one(i, ids) for i, ids in enumerate(prompts)))


async def answers_on(engine: Engine, prompts: list[list[int]], generation: Generation) -> list[list[int]]:
    """Generation on the hsx engine without capture (its blocks stay in the prefix cache)."""
    results = await asyncio.gather(*(engine.answer(ids, generation, uuid.uuid4().hex) for ids in prompts))
    return [answer for answer, _ in results]


PHASE = "gpu_model_runner: "  # vLLM's record_function names for the steps of execute_model
# vLLM's name for one engine step: requests and tokens in prefill (context) and decode (generation).
STEP = re.compile(r"execute_context_(\d+)\((\d+)\)_generation_(\d+)\((\d+)\)")
MATMUL = "_C::onednn_mm"


def profile_figures(trace_dir: str) -> dict[str, float]:
    """From the worker's traces in ``trace_dir``: milliseconds per model-runner
    phase, the pure decode steps (no prefill in the batch: count, mean ms, query
    tokens per request) and the matmul total."""
    totals: collections.Counter[str] = collections.Counter()
    for path in glob.glob(os.path.join(trace_dir, "rank*.json*")):
        opener = gzip.open if path.endswith(".gz") else open
        with opener(path, "rt") as f:
            events = json.load(f).get("traceEvents", [])
        for event in events:
            name, ms = event.get("name", ""), event.get("dur", 0) / 1000
            if event.get("ph") != "X":
                continue
            if name.startswith(PHASE):
                totals[f"phase_{name[len(PHASE):].replace(' ', '_')}_ms"] += ms
            elif name == MATMUL:
                totals["matmul_ms"] += ms
            elif (step := STEP.fullmatch(name)) and step.group(1) == "0" and int(step.group(3)) > 0:
                totals["decode_steps"] += 1
                totals["decode_ms"] += ms
                totals["decode_requests"] += int(step.group(3))
                totals["decode_tokens"] += int(step.group(4))
    out = {k: round(v, 1) for k, v in sorted(totals.items()) if k.endswith("_ms")}
    if totals["decode_steps"]:
        out["decode_steps"] = int(totals["decode_steps"])
        out["decode_step_ms"] = round(totals["decode_ms"] / totals["decode_steps"], 2)
        out["decode_query_tokens_per_request"] = round(totals["decode_tokens"] / totals["decode_requests"], 2)
    return out


def profiler_config(root: str | None, name: str) -> Any:
    from vllm.config import ProfilerConfig

    if root is None:
        return ProfilerConfig()
    return ProfilerConfig(profiler="torch", torch_profiler_dir=os.path.join(root, name),
                          torch_profiler_with_stack=False, torch_profiler_use_gzip=False)


async def profiled(llm: Any, run: Any) -> None:
    """``run()`` under the engine's profiler (the traces land when it stops)."""
    await llm.start_profile()
    try:
        await run()
    finally:
        await llm.stop_profile()


async def main_async(args: argparse.Namespace) -> dict[str, object]:
    from transformers import AutoTokenizer
    from vllm.v1.engine.async_llm import AsyncLLM

    path = models.prepare(names=[MODEL])[MODEL]
    tokenizer = AutoTokenizer.from_pretrained(path)
    model_config = text_config(str(path))
    layers = default_layer_ids(model_config.num_hidden_layers)
    count, max_tokens = (8, 16) if args.quick else (args.prompts, args.max_tokens)
    rounds = 1 if args.quick else args.rounds
    generation = Generation(max_tokens=max_tokens, ignore_eos=True)
    profile_root = tempfile.mkdtemp(prefix="hsx-profile-") if args.profile else None
    if profile_root is not None:
        os.environ["VLLM_CUSTOM_SCOPES_FOR_PROFILING"] = "1"  # the model runner's phases in the traces
    options = EngineOptions(model=str(path), layer_ids=layers, dtype="float32", max_model_len=2048,
                            enforce_eager=True,
                            engine_args={"profiler_config": profiler_config(profile_root, "one_pass"), **VLLM_PROCESSES})
    seconds: dict[str, list[float]] = {s: [] for s in SIDES}
    captured: list[int] = []
    with dev_bootstrap() as bootstrap, tempfile.TemporaryDirectory() as tmp:
        kafka = KafkaSettings(bootstrap=bootstrap)
        topics = fresh_topic_settings("bench.", partitions=1)
        ensure_topics(kafka, topics, [topics.blocks])
        completions = CompletionReceiver(Path(tmp))
        completions.start()
        connector = ConnectorConfig(
            completion_address=completions.address, kafka_settings_file=write_kafka_settings(kafka, Path(tmp)),
            blocks_topic=topics.blocks, model=MODEL,
            max_request_bytes=request_bytes_bound(options.max_model_len, len(layers), model_config.hidden_size))

        def without(speculative: bool) -> Any:
            a = engine_args(options, connector)
            a.profiler_config = profiler_config(profile_root, "spec_only" if speculative else "plain")
            a.kv_transfer_config = None
            if not speculative:
                a.speculative_config = None
            a.async_scheduling = False
            return a

        hsx = Engine(options, connector)
        plain = AsyncLLM.from_engine_args(without(speculative=False))
        spec_only = AsyncLLM.from_engine_args(without(speculative=True))

        async def side(name: str, prompts: list[list[int]]) -> float:
            start = time.perf_counter()
            if name == "one_pass":
                await capture(hsx, completions, prompts, generation)
            elif name == "two_pass_cold":
                answers = await generate(plain, prompts, max_tokens)
                await capture(hsx, completions, [p + a[:-1] for p, a in zip(prompts, answers)], None)
            elif name == "two_pass_warm":
                answers = await answers_on(hsx, prompts, generation)
                await capture(hsx, completions, [p + a[:-1] for p, a in zip(prompts, answers)], None)
            else:
                await generate(plain if name == "plain" else spec_only, prompts, max_tokens)
            return time.perf_counter() - start

        try:
            for i, name in enumerate(SIDES):  # warm-up, on prompts no round uses
                await side(name, prompts_of_round(tokenizer, 50 + i, min(count, 4)))
            for r in range(rounds):
                order = SIDES[r % len(SIDES):] + SIDES[: r % len(SIDES)]
                for k, name in enumerate(order):
                    prompts = prompts_of_round(tokenizer, r * len(SIDES) + k, count)
                    seconds[name].append(await side(name, prompts))
                    captured.append(sum(len(p) + max_tokens - 1 for p in prompts))
                    print(f"[bench.generation] round {r} {name}: {captured[-1] / seconds[name][-1]:.0f} tokens/s",
                          flush=True)
            if profile_root is not None:
                batch = prompts_of_round(tokenizer, 99, count)
                # The hsx engine's AsyncLLM: a benchmark may reach inside.
                await profiled(hsx._llm, lambda: capture(hsx, completions, batch, generation))
                await profiled(plain, lambda: generate(plain, batch, max_tokens))
                await profiled(spec_only, lambda: generate(spec_only, batch, max_tokens))
        finally:
            for llm in (plain, spec_only, hsx):
                llm.shutdown()
            await completions.close()

    # Every round's prompts differ only in their first token: the same count everywhere.
    tokens = captured[0]
    assert len(set(captured)) == 1

    def ratio(a: str, b: str) -> float:
        """median over rounds of (tokens/s of a) / (tokens/s of b)"""
        return round(statistics.median(sb / sa for sa, sb in zip(seconds[a], seconds[b])), 3)

    results: dict[str, object] = {
        "generation_model": MODEL,
        "generation_prompts": count,
        "generation_max_tokens": max_tokens,
        "generation_captured_tokens": tokens,
        "generation_rounds": rounds,
        "generation_vllm_omp_threads": omp_threads(),
        "one_pass_vs_two_pass_ratio": ratio("one_pass", "two_pass_cold"),
        "one_pass_vs_two_pass_warm_ratio": ratio("one_pass", "two_pass_warm"),
        "one_pass_vs_plain_generation_ratio": ratio("one_pass", "plain"),
        "spec_only_vs_plain_generation_ratio": ratio("spec_only", "plain"),
        "one_pass_vs_spec_only_ratio": ratio("one_pass", "spec_only"),
    }
    if profile_root is not None:
        for name in ("one_pass", "plain", "spec_only"):
            for key, value in profile_figures(os.path.join(profile_root, name)).items():
                results[f"generation_profile_{name}_{key}"] = value
    for s in SIDES:
        results[f"generation_{s}_tokens_per_s"] = round(statistics.median(tokens / x for x in seconds[s]), 1)
    return results


def main() -> None:
    parser = section.parser(__doc__)
    parser.add_argument("--prompts", type=int, default=32, help="prompts per round (the demo's, at most 64)")
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens generated per prompt")
    parser.add_argument("--no-profile", dest="profile", action="store_false",
                        help="skip the extra batch per engine under the torch profiler")
    args = parser.parse_args()
    section.emit(asyncio.run(main_async(args)), args.out)


if __name__ == "__main__":
    main()
