"""The sink at dataset scale: memory and time to ready against a dataset that
already holds many samples.

For each size (none, 10 k and 1 M samples; ``--quick``: none, 10 k and 100 k) a
dataset of tiny samples (1 token × 1 layer × 8 hidden, 10,000 to a shard) is
built through the sink's own write path (``hsx.local.datasets``, no engine), for
partition 0 of a fresh one-partition blocks topic on the embedded broker (or
``HSX_KAFKA_BOOTSTRAP``). Then ``hsx sink`` is started on it twice:

* **time to ready**: from the process's start to its first assignment
  (``hsx_sink_rebalances_total``) and to its ``/readyz`` answering 200, which
  needs the partition assigned, so its dedupe keys loaded (both polled every
  20 ms); and the assignment's own load time (``hsx_sink_partition_load_seconds``).
  The first start reads the per-shard key files and writes the partition's
  roll-up; the second reads the roll-up.
* **RSS**: the sink's resident memory once ready, minus the same with an empty
  dataset, per stored sample.

Figures go into ``bench/results.json`` as flat ``sink_scale_*`` keys (merged:
other sections' keys stay), and ``docs/benchmarks.md`` is rendered again.

    python -m bench.sink_scale [--quick] [--out F]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import psutil

from bench import report
from hsx.dataset.storage import LocalStorage
from hsx.local.broker import dev_bootstrap
from hsx.local.commands import sink_command
from hsx.local.datasets import write_tiny_dataset
from hsx.local.spawn import HsxService
from hsx.local.topics import fresh_topics
from hsx.runtime.settings import KafkaSettings, TopicSettings

ROOT = Path(__file__).resolve().parent.parent
PER_SHARD = 10_000
LOAD_SECONDS = "hsx_sink_partition_load_seconds"
KNOWN = "hsx_sink_known_samples"
REBALANCES = "hsx_sink_rebalances_total"


def build(output: Path, topic: str, samples: int) -> float:
    """The dataset; returns the seconds it took."""
    started = time.monotonic()
    write_tiny_dataset(LocalStorage(output), topic, 0, [f"scale-{i}" for i in range(samples)], per_shard=PER_SHARD,
                       dataset=output.name)
    return time.monotonic() - started


def start_to_ready(kafka: KafkaSettings, topic_settings: TopicSettings, output: Path, log_dir: Path,
                   name: str) -> dict[str, float]:
    """One sink start: seconds to ready, RSS once ready, the load's own seconds."""
    # A group of its own: joining one whose last member just left can wait on the broker's rebalance.
    group = f"{name}-{topic_settings.blocks}"
    sink = HsxService(name, sink_command(kafka.bootstrap, topic_settings, output, group=group), log_dir)
    started = time.monotonic()
    assigned_s = None
    with sink:
        while not sink.ready():
            if sink.exited() is not None or time.monotonic() - started > 300:
                raise RuntimeError(f"{name} never became ready:\n{sink.log_tail()}")
            # /metrics answers at once; /readyz asks the consumer for its assignment, which can
            # lag the assignment by many seconds (librdkafka answers it between group requests).
            if assigned_s is None and sink.metric(REBALANCES, labelled=True) >= 1:
                assigned_s = time.monotonic() - started
            time.sleep(0.02)
        ready_s = time.monotonic() - started
        time.sleep(1.0)  # let the assignment's garbage go before reading RSS
        rss = psutil.Process(sink.pid).memory_info().rss
        figures = {"ready_s": ready_s, "assigned_s": ready_s if assigned_s is None else assigned_s,
                   "rss_bytes": float(rss), "load_s": sink.metric(LOAD_SECONDS),
                   "known": sink.metric(KNOWN)}
        if sink.stop() != 0:
            raise RuntimeError(f"{name} did not stop cleanly:\n{sink.log_tail()}")
    return figures


def measure(kafka: KafkaSettings, samples: int, workdir: Path, label: str) -> dict[str, float]:
    topics = fresh_topics(kafka, partitions=1)
    output = workdir / f"dataset-{label}"
    built = build(output, topics.blocks, samples) if samples else 0.0
    first = start_to_ready(kafka, topics, output, workdir, f"sink-{label}")
    again = start_to_ready(kafka, topics, output, workdir, f"sink-{label}-again")
    if first["known"] != samples or again["known"] != samples:
        raise RuntimeError(f"the sink knew {first['known']}/{again['known']} samples, not {samples}")
    print(f"[sink_scale] {label}: {samples} samples built in {built:.1f}s; ready in {first['ready_s']:.2f}s "
          f"(load {first['load_s']:.3f}s), again {again['ready_s']:.2f}s (load {again['load_s']:.3f}s); "
          f"RSS {first['rss_bytes'] / 2**20:.1f} MiB", flush=True)
    return {"build_s": built, "first_ready_s": first["ready_s"], "first_load_s": first["load_s"],
            "ready_s": again["ready_s"], "load_s": again["load_s"], "first_assigned_s": first["assigned_s"],
            "assigned_s": again["assigned_s"],
            "rss_bytes": statistics.mean([first["rss_bytes"], again["rss_bytes"]])}


def run(quick: bool) -> dict[str, object]:
    large = 100_000 if quick else 1_000_000
    sizes = {"empty": 0, "10k": 10_000, "1m" if not quick else "100k": large}
    results: dict[str, object] = {"sink_scale_quick": quick, "sink_scale_samples_large": large,
                                  "sink_scale_samples_per_shard": PER_SHARD}
    with dev_bootstrap() as bootstrap, tempfile.TemporaryDirectory(prefix="hsx-sink-scale-") as tmp:
        kafka = KafkaSettings(bootstrap=bootstrap)
        figures = {label: measure(kafka, n, Path(tmp), label) for label, n in sizes.items()}
    base = figures["empty"]["rss_bytes"]
    for label, n in sizes.items():
        f = figures[label]
        for key in ("first_ready_s", "first_load_s", "ready_s", "load_s", "build_s", "first_assigned_s", "assigned_s"):
            results[f"sink_scale_{label}_{key}"] = round(f[key], 3)
        results[f"sink_scale_{label}_rss_mb"] = round(f["rss_bytes"] / 2**20, 1)
        if n:
            results[f"sink_scale_{label}_rss_bytes_per_sample"] = round((f["rss_bytes"] - base) / n, 1)
    top = figures["100k" if quick else "1m"]
    # The targets, at the large size: RSS growth per sample, and the time the
    # assignment spends on the dataset (the worse of the two starts). The rest of
    # start to ready (interpreter, imports, joining the group) is the same with
    # an empty dataset, reported beside it.
    results["sink_scale_rss_bytes_per_sample"] = round((top["rss_bytes"] - base) / large, 1)
    results["sink_scale_load_s"] = round(max(top["first_load_s"], top["load_s"]), 3)
    results["sink_scale_ready_s"] = round(max(top["first_ready_s"], top["ready_s"]), 3)
    results["sink_scale_empty_dataset_ready_s"] = round(max(figures["empty"]["first_ready_s"],
                                                            figures["empty"]["ready_s"]), 3)
    return results


def merge(out: Path, figures: dict[str, object]) -> dict[str, object]:
    """``figures`` merged into the results file (its other keys stay)."""
    current = json.loads(out.read_text()) if out.exists() else {}
    merged = {**current, **figures}
    merged.update(report.targets(merged))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(merged, indent=2) + "\n")
    return merged


def publish(out: Path, doc: Path, figures: dict[str, object]) -> dict[str, object]:
    """A section run on its own: ``figures`` merged into ``out``, and when that is
    the published ``bench/results.json``, its page ``doc`` rendered again."""
    merged = merge(out, figures)
    if out.resolve() == (ROOT / "bench" / "results.json").resolve():
        doc.write_text(report.render(merged))
    return merged


def standalone(description: str | None, quick_help: str, run: Callable[[bool], dict[str, object]]) -> Path:
    """``main()`` of a section run on its own: ``--quick``, ``--out``, ``--doc``,
    then :func:`publish`; returns the results file written."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help=quick_help)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results.json")
    parser.add_argument("--doc", type=Path, default=ROOT / "docs" / "benchmarks.md")
    args = parser.parse_args()
    publish(args.out, args.doc, run(args.quick))
    return args.out


def main() -> None:
    out = standalone(__doc__, "100 k samples instead of 1 M", run)
    print(f"[sink_scale] wrote {out}", file=sys.stderr)


if __name__ == "__main__":
    main()
