"""The pipeline as users run it: ``hsx produce`` (the Publisher) → Kafka → ``hsx
extract`` → ``hsx sink`` → shards, each service its own process, on the embedded
broker (or ``HSX_KAFKA_BOOTSTRAP``).

* **e2e vs extraction alone**, rounds interleaved on one warm extractor: an
  *extract* round publishes the workload and times it until the extractor's
  ``hsx_extractor_prompts_total`` (records acknowledged by Kafka) covers it, with
  no sink running; an *e2e* round starts a sink first (it joins the group and
  catches up on earlier rounds, untimed), then publishes and times until the sink's
  ``hsx_sink_ready_events_total`` covers it (shards durable, ready events acked).
* **peak RSS**: a 2,000-prompt run through extractor and sink, RSS of the
  extractor's process tree (service + vLLM engine core + worker) and of the sink
  sampled every 0.5 s.
* **1 vs 2 extractors** on a 2-partition topic: the same workload through two
  extractor processes in one group, each engine's OpenMP threads bound to one
  core (``VLLM_CPU_OMP_THREADS_BIND=0`` and ``=1``), against the single
  extractor bound to both cores.

    python -m bench.pipeline [--quick] [--out F]
"""

from __future__ import annotations

import argparse
import io
import json
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import orjson
import psutil

from bench.prompts import workload
from hsx import models
from hsx.local.broker import dev_bootstrap
from hsx.local.commands import extract_command, sink_command
from hsx.local.spawn import HsxService, cpu_engine_env
from hsx.local.topics import fresh_topics
from hsx.producer.publisher import Mapping, Publisher
from hsx.producer.sources import read_jsonl
from hsx.runtime.kafka import RecordProducer
from hsx.runtime.settings import KafkaSettings

MODEL = "smollm2-135m-instruct"
PIPELINE_LONG = [256, 384, 512, 768]
EXTRACTED = "hsx_extractor_prompts_total"
READY = "hsx_sink_ready_events_total"
DRAIN_S = 300  # how long a service may take to stop after SIGTERM


def broker_cpu_seconds() -> float:
    """CPU time of the embedded broker (a child of this process), 0 for an external one."""
    total = 0.0
    for p in psutil.Process().children(recursive=True):
        try:
            if p.name() == "tansu":
                t = p.cpu_times()
                total += t.user + t.system
        except psutil.NoSuchProcess:
            pass
    return total


def machine_seconds() -> dict[str, float]:
    """This machine's CPU seconds so far (all cores) that no process of ours is
    charged with: waiting on the disk, serving interrupts, taken by the hypervisor
    (steal). A round's share of these says whether the disk or the host, rather
    than a process, took its time."""
    t = psutil.cpu_times()
    return {"iowait": t.iowait, "irq": t.irq + t.softirq, "steal": t.steal}


def machine_delta(before: dict[str, float]) -> dict[str, float]:
    return {f"machine_{k}_s": round(v - before[k], 2) for k, v in machine_seconds().items()}


def py_spy(service: HsxService, out: Path) -> subprocess.Popen[bytes]:
    """``py-spy record`` of a service and its children (vLLM's engine core and
    worker), collapsed stacks with thread names, until SIGINT."""
    out.parent.mkdir(parents=True, exist_ok=True)
    return subprocess.Popen([str(Path(sys.executable).parent / "py-spy"), "record", "--pid", str(service.pid),
                             "--subprocesses", "--threads", "--nonblocking", "--rate", "50", "--format", "raw",
                             "-o", str(out)], stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)


def wait_until(services: list[HsxService], name: str, target: float, timeout: float = 1800,
               sample=None) -> float:  # type: ignore[no-untyped-def]
    """Poll ``name`` (summed over ``services``) until it reaches ``target``; returns the time."""
    deadline = time.monotonic() + timeout
    while True:
        if sum(s.counter(name) for s in services) >= target:
            return time.perf_counter()
        if time.monotonic() > deadline:
            raise TimeoutError(f"{name} did not reach {target} in {timeout:.0f}s")
        if sample is not None:
            sample()
        time.sleep(0.2)


class Bench:
    def __init__(self, bootstrap: str, work: Path, model_dir: Path, tokenizer,  # type: ignore[no-untyped-def]
                 by_reference: bool = False, files: Path | None = None) -> None:
        """``files``: where the staging directory and the dataset go (default ``work``, beside the logs)."""
        self.kafka = KafkaSettings(bootstrap=bootstrap)
        self.files = files or work
        self.transport = ["--payload-store", str(self.files / "staging")] if by_reference else []
        self.topic_settings = fresh_topics(self.kafka, prefix="bench.")
        self.work = work
        self.model_dir = model_dir
        self.tokenizer = tokenizer
        self.publisher = Publisher(RecordProducer.connect(self.kafka, "producer"), self.topic_settings.topics(), Mapping())
        self.published = 0
        self.sunk = 0  # samples written by sinks that have exited
        self.sinks = 0

    def publish(self, prompts: list[list[int]], tag: str) -> None:
        lines = b"\n".join(orjson.dumps({"request_id": f"{tag}-{i}", "token_ids": ids}) for i, ids in enumerate(prompts))
        summary = self.publisher.publish(read_jsonl(io.BytesIO(lines), tag))
        assert summary.sent == len(prompts), summary.describe()
        self.published += len(prompts)

    def extractor(self, name: str, **env: str) -> HsxService:
        """A running extractor; ``env`` over :func:`cpu_engine_env`."""
        command = extract_command(self.kafka.bootstrap, self.topic_settings, self.model_dir, "--max-model-len", "2048",
                                  *self.transport, group="bench-extractor")
        return HsxService(name, command, self.work, env=cpu_engine_env(**env), stats=True).start()

    def sink(self, nice: int = 0) -> HsxService:
        """A running sink (``sink-1``, ``sink-2``, ...)."""
        self.sinks += 1
        command = sink_command(self.kafka.bootstrap, self.topic_settings, self.files / "dataset", "--max-shard-age",
                               "0.5", "--max-shard-samples", "64", *self.transport, group="bench-sink")
        service = HsxService(f"sink-{self.sinks}", command, self.work, stats=True).start()
        if nice:
            psutil.Process(service.pid).nice(nice)
        return service

    def extract_round(self, extractors: list[HsxService], prompts: list[list[int]], tag: str,
                      timeout: float = 1800) -> float:
        target = sum(e.counter(EXTRACTED) for e in extractors) + len(prompts)
        cpu = [sum(e.cpu_seconds() for e in extractors), broker_cpu_seconds()]
        machine = machine_seconds()
        start = time.perf_counter()
        self.publish(prompts, tag)
        seconds = wait_until(extractors, EXTRACTED, target, timeout=timeout) - start
        used = [sum(e.cpu_seconds() for e in extractors), broker_cpu_seconds()]
        self.last_extract = {**{f"cpu_{k}_s": round(b - a, 2) for k, a, b in zip(("extractor", "broker"), cpu, used)},
                             **machine_delta(machine)}
        return seconds

    def e2e_round(self, extractor: HsxService, prompts: list[list[int]], tag: str, sample=None,  # type: ignore[no-untyped-def]
                  profile: Path | None = None, nice: int = 0) -> tuple[float, dict]:
        sink = self.sink(nice)
        wait_until([extractor], EXTRACTED, self.published)  # nothing of earlier rounds still extracting
        # Started and assigned, untimed: with nothing to catch up on, the wait below ends
        # at once, and the sink's start (imports, joining the group: ~2 CPU-s) was timed.
        sink.wait_ready()
        wait_until([sink], READY, self.published - self.sunk, timeout=600)  # caught up, untimed
        spies = [] if profile is None else [py_spy(s, profile / f"{tag}-{s.name}.txt") for s in (extractor, sink)]
        cpu = [s.cpu_seconds() for s in (extractor, sink)] + [broker_cpu_seconds()]
        machine = machine_seconds()
        extracted_at: list[float] = []

        def watch() -> None:
            if not extracted_at and extractor.counter(EXTRACTED) >= self.published:
                extracted_at.append(time.perf_counter())
            if sample is not None:
                sample()

        start = time.perf_counter()
        self.publish(prompts, tag)
        seconds = wait_until([sink], READY, self.published - self.sunk, sample=watch) - start
        used = [s.cpu_seconds() for s in (extractor, sink)] + [broker_cpu_seconds()]
        self.last_e2e = {"extracted_s": (extracted_at or [start + seconds])[0] - start,
                         **{f"cpu_{k}_s": round(b - a, 2) for k, a, b in zip(("extractor", "sink", "broker"), cpu, used)},
                         **machine_delta(machine)}
        for spy in spies:
            spy.send_signal(signal.SIGINT)
            spy.wait(timeout=60)
        sink.stop(DRAIN_S)
        stats = sink.read_stats()
        self.sunk += int(stats.get("samples", 0))
        return seconds, stats


def rss_run(bench: Bench, extractor: HsxService, tokenizer, count: int, results: dict) -> None:  # type: ignore[no-untyped-def]
    """Peak RSS over a long run (short prompts: many requests, few tokens)."""
    from bench.prompts import demo_token_ids

    many = [[100 + i // 64] + ids for i, ids in enumerate(demo_token_ids(tokenizer, repeat=32))][:count]
    samples: list[tuple[float, int, int]] = []
    sink_box: list = []

    def sample() -> None:
        if not samples or time.monotonic() - samples[-1][0] >= 0.5:
            done = extractor.counter(EXTRACTED)
            samples.append((time.monotonic(), extractor.rss_bytes(), sink_box[0].rss_bytes() if sink_box else 0))
            progress.append(done)

    progress: list[float] = []
    start_count = extractor.counter(EXTRACTED)
    sink = bench.sink()
    sink_box.append(sink)
    wait_until([extractor], EXTRACTED, bench.published)
    wait_until([sink], READY, bench.published - bench.sunk, timeout=600)
    start = time.perf_counter()
    bench.publish(many, "rss")
    seconds = wait_until([sink], READY, bench.published - bench.sunk, sample=sample) - start
    sample()
    sink.stop(DRAIN_S)
    bench.sunk += int(sink.read_stats().get("samples", 0))
    total = len(many)
    for share in (0.1, 0.5, 1.0):
        i = next((k for k, p in enumerate(progress) if p - start_count >= share * total), len(samples) - 1)
        results[f"rss_extractor_mb_at_{int(share * 100)}pct"] = round(samples[i][1] / 2**20, 1)
        results[f"rss_sink_mb_at_{int(share * 100)}pct"] = round(samples[i][2] / 2**20, 1)
    results["rss_run_prompts"] = total
    results["rss_run_tokens"] = sum(len(p) for p in many)
    results["rss_run_e2e_tokens_per_s"] = round(results["rss_run_tokens"] / seconds, 1)  # type: ignore[operator]
    results["peak_rss_extractor_mb"] = round(max(s[1] for s in samples) / 2**20, 1)
    results["peak_rss_sink_mb"] = round(max(s[2] for s in samples) / 2**20, 1)


def two_extractors(bench: Bench, prompts: list[list[int]], tokens: int, extract_s: list[float], results: dict) -> None:
    """1 vs 2 extractors, each engine bound to one core."""
    pair = [bench.extractor(f"extractor-core{c}", VLLM_CPU_OMP_THREADS_BIND=str(c)) for c in (0, 1)]
    try:
        deadline = time.monotonic() + 900
        attempt = 0
        while not all(e.counter(EXTRACTED) > 0 for e in pair):  # both hold a partition and have a warm engine
            if time.monotonic() > deadline:
                raise TimeoutError("the two extractors did not both start extracting")
            bench.publish(prompts[:8], f"warmup2-{attempt}")
            attempt += 1
            try:
                wait_until(pair, EXTRACTED, sum(e.counter(EXTRACTED) for e in pair) + 8, timeout=120)
            except TimeoutError:
                pass  # e.g. a rebalance replayed or moved prompts; publish more and look again
        before = [e.counter(EXTRACTED) for e in pair]
        two_s = bench.extract_round(pair, prompts, "two", timeout=600)
        shares = [e.counter(EXTRACTED) - b for e, b in zip(pair, before)]
    finally:
        for e in pair:
            e.stop(DRAIN_S)
    results["two_extractors_tokens_per_s"] = round(tokens / two_s, 1)
    results["one_extractor_tokens_per_s"] = results["pipeline_extract_tokens_per_s"]
    results["two_vs_one_extractors_ratio"] = round(statistics.median(extract_s) / two_s, 3)
    results["two_extractors_prompt_split"] = shares


def main_async(args: argparse.Namespace) -> dict[str, object]:
    from transformers import AutoTokenizer

    model_dir = models.prepare(names=[MODEL])[MODEL]
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompts = workload(tokenizer, PIPELINE_LONG[:1] if args.quick else PIPELINE_LONG, repeat=1 if args.quick else 3)
    tokens = sum(len(p) for p in prompts)
    rounds = 1 if args.quick else args.rounds
    rss_prompts = 200 if args.quick else 2000
    results: dict[str, object] = {"pipeline_workload_prompts": len(prompts), "pipeline_workload_tokens": tokens,
                                  "pipeline_rounds": rounds}
    out_dir = Path(tempfile.mkdtemp(prefix="hsx-bench-"))
    print(f"[bench.pipeline] logs and dataset in {out_dir} (removed at the end unless --keep)", flush=True)
    with dev_bootstrap() as bootstrap:
        files = None if args.files_in is None else Path(tempfile.mkdtemp(prefix="hsx-bench-", dir=args.files_in))
        bench = Bench(bootstrap, out_dir, model_dir, tokenizer, args.by_reference, files)
        extractor = bench.extractor("extractor")
        try:
            warmup = prompts[:8] if args.quick else prompts  # a whole untimed round: engine and caches warm
            bench.publish(warmup, "warmup")
            wait_until([extractor], EXTRACTED, len(warmup), timeout=900)
            extract_s, e2e_s = [], []
            detail: list[dict] = []
            kinds = ["extract", "e2e"] + (["e2e_nice"] if args.sink_nice else [])
            nice_s: list[float] = []
            for r in range(rounds):
                for kind in kinds[r % len(kinds):] + kinds[: r % len(kinds)]:
                    if kind == "extract":
                        extract_s.append(bench.extract_round([extractor], prompts, f"x{r}"))
                        detail.append({"kind": kind, **bench.last_extract})
                        seconds = extract_s[-1]
                    else:
                        seconds = bench.e2e_round(extractor, prompts, f"{kind}{r}", profile=args.profile,
                                                  nice=args.sink_nice if kind == "e2e_nice" else 0)[0]
                        (e2e_s if kind == "e2e" else nice_s).append(seconds)
                        detail.append({"kind": kind, **bench.last_e2e})
                    print(f"[bench.pipeline] round {r} {kind}: {tokens / seconds:.0f} tokens/s {detail[-1]}", flush=True)
            results["e2e_ratio"] = round(statistics.median(x / e for x, e in zip(extract_s, e2e_s)), 3)
            if nice_s:
                results["sink_nice"] = args.sink_nice
                results["e2e_ratio_sink_niced"] = round(statistics.median(x / e for x, e in zip(extract_s, nice_s)), 3)
                results["pipeline_e2e_sink_niced_tokens_per_s_rounds"] = [round(tokens / s, 1) for s in nice_s]
            results["pipeline_extract_tokens_per_s"] = round(tokens / statistics.median(extract_s), 1)
            results["pipeline_e2e_tokens_per_s"] = round(tokens / statistics.median(e2e_s), 1)
            results["pipeline_extract_tokens_per_s_rounds"] = [round(tokens / s, 1) for s in extract_s]
            results["pipeline_e2e_tokens_per_s_rounds"] = [round(tokens / s, 1) for s in e2e_s]
            e2e_detail = [d for d in detail if d["kind"] == "e2e"]
            x_detail = [d for d in detail if d["kind"] == "extract"]
            results["pipeline_e2e_extraction_done_s"] = [round(d["extracted_s"], 2) for d in e2e_detail]
            results["pipeline_e2e_s"] = [round(s, 2) for s in e2e_s]
            results["pipeline_e2e_tail_s"] = round(statistics.median(
                s - d["extracted_s"] for s, d in zip(e2e_s, e2e_detail)), 2)
            results["pipeline_extract_s"] = [round(s, 2) for s in extract_s]
            for who in ("extractor", "sink", "broker"):
                results[f"pipeline_e2e_cpu_{who}_s"] = [d[f"cpu_{who}_s"] for d in e2e_detail]
            for who in ("extractor", "broker"):
                results[f"pipeline_extract_cpu_{who}_s"] = [d[f"cpu_{who}_s"] for d in x_detail]
            for what in ("iowait", "irq", "steal"):
                for kind, rounds_of in (("e2e", e2e_detail), ("extract", x_detail)):
                    results[f"pipeline_{kind}_machine_{what}_s"] = [d[f"machine_{what}_s"] for d in rounds_of]

            if not args.skip_rss:
                rss_run(bench, extractor, tokenizer, rss_prompts, results)
        finally:
            extractor.stop(DRAIN_S)

        if not args.skip_two:
            try:
                two_extractors(bench, prompts, tokens, extract_s, results)
            except (TimeoutError, RuntimeError) as exc:  # keep every other figure of this section
                results["two_extractors_error"] = str(exc)
                print(f"[bench.pipeline] 1 vs 2 extractors failed: {exc}", flush=True)
    if not args.keep:
        shutil.rmtree(out_dir, ignore_errors=True)
        shutil.rmtree(bench.files, ignore_errors=True)
    if args.by_reference:  # beside the inline figures, not over them
        results = {("e2e_ratio_by_reference" if k == "e2e_ratio" else k.replace("pipeline_", "pipeline_by_reference_", 1)):
                   v for k, v in results.items() if k.startswith(("pipeline_", "e2e_ratio")) and "niced" not in k}
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--rounds", type=int, default=5, help="e2e and extract rounds, interleaved (default %(default)s: 3 were too noisy for a 10 %% target)")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--profile", type=Path, help="py-spy the extractor and sink in e2e rounds, stacks to DIR")
    parser.add_argument("--sink-nice", type=int, default=10,
                        help="also e2e rounds with the sink at this nice level (0: none)")
    parser.add_argument("--skip-rss", action="store_true", help="no 2,000-prompt run")
    parser.add_argument("--keep", action="store_true", help="keep the logs and the dataset")
    parser.add_argument("--files-in", type=Path, metavar="DIR",
                        help="the staging directory and the dataset in a new folder under DIR (e.g. /dev/shm: no disk "
                             "under them), not beside the logs")
    parser.add_argument("--skip-two", action="store_true", help="no 1 vs 2 extractors")
    parser.add_argument("--by-reference", action="store_true",
                        help="extractor and sinks pass hidden states through a staging directory (--payload-store): "
                             "e2e_ratio_by_reference and pipeline_by_reference_* (no RSS run, no 1 vs 2 extractors)")
    args = parser.parse_args()
    if args.by_reference:
        args.skip_rss, args.skip_two, args.sink_nice = True, True, 0
    text = json.dumps(main_async(args), indent=2)
    if args.out:
        args.out.write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
