"""``hsx demo``: the whole pipeline on a fresh machine, on CPU.

Embedded broker (or ``HSX_KAFKA_BOOTSTRAP``) → 64 bundled prompts (text and chats)
→ ``hsx extract`` with SmolLM2-135M-Instruct → ``hsx sink`` → a sharded dataset in
``out/demo``; then one sample is checked against HF transformers and a summary of
real measurements is printed. Child processes are stopped on exit and on Ctrl-C.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from importlib import resources
from pathlib import Path

import orjson

from hsx import models
from hsx.reference import HFReference, max_relative_error
from producer.publisher import Mapping, Publisher
from producer.sources import read_jsonl
from runtime.broker import dev_bootstrap
from runtime.kafka import DeliveryTracker, ensure_topics, make_producer
from runtime.kafka.drain import drain
from runtime.settings import KafkaSettings, TopicSettings
from sink.reader import open_dataset

DEMO_PROMPTS = "demo_prompts.jsonl"
MODEL = "smollm2-135m-instruct"


def cpu_engine_env() -> dict[str, str]:
    """The environment for vLLM child processes on a CPU development machine: all
    cores for the engine (vLLM reserves one by default), a 2 GiB KV cache, no hub."""
    env = dict(os.environ)
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{(os.cpu_count() or 1) - 1}")
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    env["HF_HUB_OFFLINE"] = "1"
    return env


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--output", type=Path, default=Path("out/demo"), help="dataset directory (emptied first)")


def run(args: argparse.Namespace) -> int:
    model_dir = models.prepare(names=[MODEL])[MODEL]
    output: Path = args.output
    shutil.rmtree(output, ignore_errors=True)
    (output / "logs").mkdir(parents=True)
    suffix = uuid.uuid4().hex[:8]
    topic_settings = TopicSettings(prompts=f"demo.prompts-{suffix}", prompts_dlq=f"demo.prompts.dlq-{suffix}",
                                   blocks=f"demo.blocks-{suffix}", blocks_dlq=f"demo.blocks.dlq-{suffix}",
                                   ready=f"demo.ready-{suffix}", partitions=2)
    topics = topic_settings.topics()
    with dev_bootstrap() as bootstrap:
        kafka = KafkaSettings(bootstrap=bootstrap)
        ensure_topics(kafka, topic_settings, [topics.prompts, topics.prompts_dlq, topics.blocks, topics.blocks_dlq,
                                              topics.ready])
        with (resources.files("hsx") / "data" / DEMO_PROMPTS).open("rb") as stream:
            published = Publisher(DeliveryTracker(make_producer(kafka)), topics, Mapping()).publish(
                read_jsonl(stream, DEMO_PROMPTS))
        print(f"[demo] producer: {published.describe()}", flush=True)

        common = ["--bootstrap", bootstrap, "--session-timeout-ms", "6000"]
        sink = spawn_hsx(["sink", *common, "--output", str(output), "--topic", topics.blocks, "--ready-topic",
                          topics.ready, "--dlq-topic", topics.blocks_dlq, "--max-shard-age", "20",
                          "--stats-file", str(output / "logs/sink-stats.json")], output / "logs/sink.log")
        started = time.monotonic()
        extractor = spawn_hsx(["extract", *common, "--model", str(model_dir), "--dtype", "float32", "--enforce-eager",
                               "--max-model-len", "2048", "--topic", topics.prompts, "--blocks-topic", topics.blocks,
                               "--dlq-topic", topics.prompts_dlq, "--exit-when-idle", "10",
                               "--stats-file", str(output / "logs/extractor-stats.json")], output / "logs/extractor.log")
        try:
            print("[demo] extractor and sink running (logs in", output / "logs", ")", flush=True)
            if extractor.wait() != 0:
                print(f"[demo] FAILED: the extractor exited with {extractor.returncode}", file=sys.stderr)
                return 1
            wall = time.monotonic() - started
            sink.send_signal(signal.SIGTERM)  # drain: write open shards, publish, commit
            if sink.wait(timeout=300) != 0:
                print(f"[demo] FAILED: the sink exited with {sink.returncode}", file=sys.stderr)
                return 1
        finally:
            for child in (extractor, sink):
                if child.poll() is None:
                    child.kill()
        ready = len(drain(kafka, topics.ready, expected=published.sent, settle=3.0))
    extracted = orjson.loads((output / "logs/extractor-stats.json").read_bytes())
    sunk = orjson.loads((output / "logs/sink-stats.json").read_bytes())
    return _report(output, model_dir, published.sent, extracted, sunk, ready, wall)


def spawn_hsx(args: list[str], log: Path, **env: str) -> subprocess.Popen[bytes]:
    """``hsx ARGS`` as a child process (demo, benchmarks), output to ``log``;
    ``env`` overrides :func:`cpu_engine_env` (e.g. ``VLLM_CPU_OMP_THREADS_BIND``)."""
    with log.open("wb") as handle:
        return subprocess.Popen([sys.executable, "-m", "hsx.cli", *args], stdout=handle, stderr=subprocess.STDOUT,
                                env={**cpu_engine_env(), **env})


def _report(output: Path, model_dir: Path, sent: int, extracted: dict, sunk: dict, ready: int, wall: float) -> int:
    dataset = open_dataset(output)
    request_ids = dataset.request_ids()
    probe = sorted(request_ids)[0]
    sample = dataset[probe]
    reference = HFReference(model_dir).hidden_states(sample["token_ids"].tolist(), dataset.event(probe).layer_ids)
    error = max_relative_error(sample["hidden_states"], reference)
    raw, compressed = extracted["raw_bytes"], extracted["compressed_bytes"]
    rows = [
        ("prompts published", f"{sent}"),
        ("samples in the dataset (distinct ids)", f"{len(request_ids)}"),
        ("ready events on the topic", f"{ready}"),
        ("tokens", f"{sum(dataset.event(r).num_tokens for r in request_ids)}"),
        ("extraction tokens/s (first prompt to last ack)", f"{extracted['tokens_per_second']:.0f}"),
        ("wall time incl. engine start", f"{wall:.0f} s"),
        ("hidden-state bytes raw → compressed", f"{raw:,} → {compressed:,} ({raw / max(compressed, 1):.2f}x)"),
        ("shards written", f"{sunk['shards']}"),
        ("duplicates dropped / rejected", f"{sunk['duplicates']} / {sunk['rejected']}"),
        (f"max rel. error vs HF transformers ({probe})", f"{error:.1e}"),
    ]
    width = max(len(r[0]) for r in rows)
    print("\n".join(f"  {name:<{width}}  {value}" for name, value in rows))
    ok = len(request_ids) == sent == ready and error <= 1e-4
    print(f"[demo] {'OK' if ok else 'FAILED'}: dataset in {output}, read it with sink.reader.open_dataset('{output}')")
    return 0 if ok else 1
