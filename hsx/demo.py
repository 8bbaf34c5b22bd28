"""``hsx demo``: the whole pipeline on a fresh machine, on CPU.

Embedded broker (or ``HSX_KAFKA_BOOTSTRAP``) → 64 bundled prompts (text and chats)
→ ``hsx extract`` with SmolLM2-135M-Instruct → ``hsx sink`` → a sharded dataset in
``out/demo``; then one sample is checked against HF transformers and a summary of
real measurements is printed. Child processes are stopped on exit and on Ctrl-C.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import time
from importlib import resources
from pathlib import Path

from hsx import models
from hsx.dev.commands import extract_command, sink_command
from hsx.dev.spawn import HsxService
from hsx.dev.topics import fresh_topics
from hsx.reference import HFReference, max_relative_error
from producer.publisher import Mapping, Publisher
from producer.sources import read_jsonl
from runtime.broker import dev_bootstrap
from runtime.kafka import DeliveryTracker, make_producer
from runtime.kafka.drain import drain
from runtime.settings import KafkaSettings
from sink.reader import open_dataset

DEMO_PROMPTS = "demo_prompts.jsonl"
MODEL = "smollm2-135m-instruct"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--output", type=Path, default=Path("out/demo"), help="dataset directory (emptied first)")


def run(args: argparse.Namespace) -> int:
    model_dir = models.prepare(names=[MODEL])[MODEL]
    output: Path = args.output
    shutil.rmtree(output, ignore_errors=True)
    logs = output / "logs"
    logs.mkdir(parents=True)
    with dev_bootstrap() as bootstrap:
        kafka = KafkaSettings(bootstrap=bootstrap)
        topic_settings = fresh_topics(kafka, prefix="demo.")
        topics = topic_settings.topics()
        with (resources.files("hsx") / "data" / DEMO_PROMPTS).open("rb") as stream:
            published = Publisher(DeliveryTracker(make_producer(kafka)), topics, Mapping()).publish(
                read_jsonl(stream, DEMO_PROMPTS))
        print(f"[demo] producer: {published.describe()}", flush=True)

        sink = HsxService("sink", sink_command(bootstrap, topic_settings, output, "--max-shard-age", "20"), logs,
                          stats=True)
        extractor = HsxService("extractor", extract_command(bootstrap, topic_settings, model_dir, "--max-model-len",
                                                            "2048", "--exit-when-idle", "10"), logs, stats=True)
        with sink:
            started = time.monotonic()
            with extractor:
                print("[demo] extractor and sink running (logs in", logs, ")", flush=True)
                if extractor.wait() != 0:
                    print(f"[demo] FAILED: the extractor exited with {extractor.exited()}", file=sys.stderr)
                    return 1
                wall = time.monotonic() - started
                if sink.stop(timeout=300) != 0:  # drain: write open shards, publish, commit
                    print(f"[demo] FAILED: the sink exited with {sink.exited()}", file=sys.stderr)
                    return 1
        ready = len(drain(kafka, topics.ready, expected=published.sent, settle=3.0))
    return _report(output, model_dir, published.sent, extractor.read_stats(), sink.read_stats(), ready, wall)


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
