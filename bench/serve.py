"""vLLM's OpenAI server with and without capture, under vLLM's own load generator
(``vllm bench serve``'s code: ``vllm.benchmarks.serve``), in one run on one machine.

Arms, each a server of its own with the same engine flags:

* ``plain``: vLLM's server with ``extract_hidden_states`` off (no capture);
* ``plain_sync``: ``plain`` with ``--no-async-scheduling``: vLLM schedules the
  next step while the current one runs, but not with ``extract_hidden_states``
  (``vllm/config/vllm.py`` turns it off), so this is plain on the capturing arms'
  scheduler;
* ``drafts``: vLLM's ``extract_hidden_states`` method as the seed configures it,
  no connector: a draft token a decode step (the sampled one again, nearly
  always rejected);
* ``method``: the method as hsx configures it, no connector: no draft token
  (:mod:`hsx.extractor.no_draft_tokens`), the dummy draft and its hidden-state
  cache, nothing saved (what the method costs before any connector does); the
  arms below run it too;
* ``stock``: vLLM's own ``ExampleHiddenStatesConnector`` (its CPU port,
  :mod:`bench.files_connector`: only the device copy differs), a file per response;
* ``files``: the seed's command with HsxConnector and ``shared_storage_path`` (a
  file per response);
* ``kafka``: the connector's Kafka side by reference (a staging directory) and an
  ``hsx sink`` writing a raw dataset: what ``hsx serve --output`` runs, with
  files too (``hsx serve``'s usual case).

Paired and interleaved: the servers of a group of arms are up together
(:data:`GROUPS`; idle ones take memory, not cores), and each pass sends one burst
to each arm of the group in turn at
concurrency 1, then 8, then 32, the arms' order rotated each pass. A burst is the
random dataset with a seed of its pass and concurrency, the same prompts for
every arm of that pass (new ones each pass: vLLM's prefix cache never answers a
prefill). Between bursts the machine settles (every server and sink idle, the
burst's captures reported), so one arm's leftover work does not slow the next.
Whatever drifts on a shared machine over minutes then moves the arms of a pass
together; a ratio is read within a pass (an arm against ``plain`` of the same
pass and concurrency), and reported as the median over ``--rounds`` passes (6)
with a bootstrap 95 % interval of that median (``_ci95``). Per arm and
concurrency: requests/s, output tokens/s, TTFT p50/p99 (vLLM's figures), capture
lag p50/p99 (from the connector's own report of each capture: the response's end
to the file complete or the sample acknowledged by Kafka; the bench receives the
reports as ``hsx serve`` does), CPU-seconds of the server's process tree per burst
and per GB of hidden states captured, and of the sink and the broker per burst
(``kafka``: on one machine they take cores the engine would have); medians over
passes. Absolute numbers on a shared
2-core machine are noise; the ratios are the figures to read.

    python -m bench.serve [--quick] [--rounds N] [--arms ARM ...] [--concurrency C ...]
                          [--burst-scale K] [--engine-cpus CPU ...] [--out FILE]
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
from argparse import Namespace
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import psutil

from bench.section import emit, parser
from hsx import models
from hsx.extractor.cpu_defaults import BIND_ENV, cpu_list
from hsx.extractor.engine import kv_transfer_config, speculative_config
from hsx.local.broker import EmbeddedBroker
from hsx.local.commands import STEADY_SESSION_TIMEOUT_MS, sink_command
from hsx.local.spawn import HsxService, cpu_engine_env
from hsx.local.topics import fresh_topics
from hsx.runtime.settings import KafkaSettings
from hsx.schemas.connector import REPORTS_KEY
from hsx.serving.command import SERVER
from hsx.serving.reports import ReportReceiver, Tally

MODEL = "smollm2-135m-instruct"
LAYERS = [2, 15, 27, 30]
CONCURRENCY = [1, 8, 32]
BURST = {1: 8, 8: 32, 32: 64}
"""Prompts a burst at each concurrency: c = 32 runs two full waves."""
INPUT_LEN, OUTPUT_LEN = 256, 16
ARMS = ["plain", "plain_sync", "drafts", "method", "stock", "files", "kafka"]
RATIO_BASES = ("plain", "plain_sync", "method", "stock")
GROUPS = (["plain", "method", "stock", "files", "kafka"], ["plain", "plain_sync", "drafts", "method"])
"""Arms whose servers are up at once: a server takes about 3 GiB (vLLM's API
server, EngineCore and Worker processes, each with torch, and 1 GiB of KV cache),
and all seven do not fit 24 GiB. Every group has ``plain``, so every ratio to it is
read within a group; ``method`` is in both (÷ method for the capturing arms and
against the scheduler and the draft token). The capturing arms first: an arm in
two groups reports its first group's figures."""
WORST = (("serve_files_vs_stock_min", ("files",), "stock"),
         ("serve_capture_vs_plain_min", ("files", "kafka"), "plain"),
         ("serve_capture_vs_plain_sync_min", ("files", "kafka"), "plain_sync"),
         ("serve_capture_vs_method_min", ("files", "kafka"), "method"),
         ("serve_method_vs_plain_min", ("method",), "plain"),
         ("serve_drafts_vs_plain_min", ("drafts",), "plain"))
"""The summary figures: the lowest over concurrencies (and arms) of ``<arm> ÷ <base>``,
each with its bootstrap interval (``_ci95``)."""
QUIET_CPU_S = 0.05
"""CPU-seconds all servers and sinks together may use in half a second and count as settled."""


def _server(name: str, model: Path, extra: dict[str, Any] | None, work: Path) -> HsxService:
    args = ["--model", str(model), "--dtype", "float32", "--max-model-len", "1024", "--enforce-eager",
            "--host", "127.0.0.1", "--disable-log-stats"]
    if name == "plain_sync":
        args.append("--no-async-scheduling")
    elif name != "plain":
        speculative = speculative_config(LAYERS)
        if name == "drafts":
            del speculative["num_speculative_tokens_per_batch_size"]
        args += ["--speculative-config", json.dumps(speculative)]
    if extra is not None:
        transfer = kv_transfer_config(extra)
        if name == "stock":
            transfer.update(kv_connector="CpuHiddenStatesFileConnector",
                            kv_connector_module_path="bench.files_connector")
        args += ["--kv-transfer-config", json.dumps(transfer)]
    # 1 GiB of KV cache holds c = 32's 8,704 tokens several times over, and a group's servers fit 24 GiB.
    env = cpu_engine_env(VLLM_CPU_KVCACHE_SPACE="1")  # the OpenMP binding: main's
    return HsxService(name, args, work, env=env, module=SERVER, port_flag="--port", ready_path="/health")


def _load(url: str, model: Path, concurrency: int, prompts: int, seed: int) -> dict[str, Any]:
    """One run of vLLM's load generator; its result dict."""
    from vllm.benchmarks.serve import add_cli_args, main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    cli = FlexibleArgumentParser()
    add_cli_args(cli)
    args = cli.parse_args([
        "--backend", "vllm", "--base-url", url, "--endpoint", "/v1/completions", "--model", str(model),
        "--dataset-name", "random", "--random-input-len", str(INPUT_LEN), "--random-output-len", str(OUTPUT_LEN),
        "--num-prompts", str(prompts), "--max-concurrency", str(concurrency), "--seed", str(seed), "--ignore-eos",
        "--percentile-metrics", "ttft,tpot,e2el", "--metric-percentiles", "50,99", "--disable-tqdm"])
    return main(args)  # type: ignore[no-any-return]


def warm_up(url: str, model: Path) -> None:
    """Eight requests at c = 8, untimed: the first requests of a server pay its warm-up."""
    _load(url, model, 8, 8, seed=10_000)


@dataclass
class Arm:
    """One arm's server, up for the whole run, with what its captures need: the
    connector's report receiver (``files``, ``kafka``) and a sink (``kafka``)."""

    name: str
    server: HsxService
    reports: ReportReceiver | None = None
    sink: HsxService | None = None
    broker: psutil.Process | None = None
    """The broker its connector and sink talk to (``kafka``), for its CPU time."""

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.port}"

    @property
    def tally(self) -> Tally | None:
        """The reports of the output this arm's capture lag is read from."""
        if self.reports is None:
            return None
        return self.reports.samples if self.name == "kafka" else self.reports.files

    def services(self) -> list[HsxService]:
        return [self.server, *([self.sink] if self.sink else [])]

    def helpers_cpu_seconds(self) -> dict[str, float]:
        """CPU time so far of what serves this arm's captures besides the server: its sink and the broker."""
        if self.sink is None or self.broker is None:
            return {}
        return {"sink": self.sink.cpu_seconds(), "broker": sum(self.broker.cpu_times()[:2])}


def start_arm(name: str, model: Path, work: Path, broker: EmbeddedBroker, stack: ExitStack) -> Arm:
    """Start ``name``'s server (and sink), registered on ``stack`` to stop with the run."""
    bootstrap = broker.bootstrap
    work.mkdir()
    reports = ReportReceiver(work) if name in ("files", "kafka") else None
    extra: dict[str, Any] | None = None
    sink: HsxService | None = None
    if name == "stock":
        extra = {"shared_storage_path": str(work / "files")}
    if reports is not None:
        stack.callback(reports.close)
        extra = {"shared_storage_path": str(work / "files"), REPORTS_KEY: reports.address}
    if name == "kafka":
        assert extra is not None
        topics = fresh_topics(KafkaSettings(bootstrap=bootstrap), partitions=2)
        extra["hsx"] = {"bootstrap": bootstrap, "blocks_topic": topics.blocks, "payload_store": str(work / "staging"),
                        "codec": "none"}
        sink = stack.enter_context(HsxService(
            "sink", sink_command(bootstrap, topics, work / "dataset", "--flush-when-idle", "1", "--payload-store",
                                 str(work / "staging"), session_timeout_ms=STEADY_SESSION_TIMEOUT_MS), work))
    server = stack.enter_context(_server(name, model, extra, work))
    server.wait_ready(timeout=900)
    return Arm(name, server, reports, sink, psutil.Process(broker.pid) if sink else None)


def settle(arms: list[Arm], timeout: float = 60.0) -> None:
    """Wait until every server and sink is idle (their CPU over half a second
    under :data:`QUIET_CPU_S`), or ``timeout``."""
    services = [s for arm in arms for s in arm.services()]
    deadline = time.monotonic() + timeout
    before = sum(s.cpu_seconds() for s in services)
    while time.monotonic() < deadline:
        time.sleep(0.5)
        now = sum(s.cpu_seconds() for s in services)
        if now - before < QUIET_CPU_S:
            return
        before = now


def burst(arm: Arm, model: Path, concurrency: int, prompts: int, seed: int) -> dict[str, Any]:
    """One load burst against ``arm``: its figures, keyed ``serve_<arm>_c<N>_*``."""
    if arm.reports is not None:
        arm.reports.files, arm.reports.samples = Tally(), Tally()
    tally = arm.tally
    before_cpu, helpers_before = arm.server.cpu_seconds(), arm.helpers_cpu_seconds()
    result = _load(arm.url, model, concurrency, prompts, seed)
    if tally is not None:  # the burst's last captures' reports
        deadline = time.monotonic() + 60
        while tally.ok + tally.failed < result["completed"] and time.monotonic() < deadline:
            time.sleep(0.1)
    cpu = arm.server.cpu_seconds() - before_cpu
    key = f"serve_{arm.name}_c{concurrency}"
    figures: dict[str, Any] = {
        f"{key}_requests_per_s": round(result["request_throughput"], 3),
        f"{key}_output_tokens_per_s": round(result["output_throughput"], 2),
        f"{key}_ttft_p50_ms": round(result["p50_ttft_ms"], 1),
        f"{key}_ttft_p99_ms": round(result["p99_ttft_ms"], 1),
        f"{key}_completed": result["completed"],
        f"{key}_server_cpu_s": round(cpu, 2),
        **{f"{key}_{name}_cpu_s": round(after - helpers_before[name], 2)
           for name, after in arm.helpers_cpu_seconds().items()},
    }
    if tally is not None:
        for name, q in (("p50", 0.5), ("p99", 0.99)):
            lag = tally.lag_quantile(q)
            figures[f"{key}_capture_lag_{name}_s"] = None if lag is None else round(lag, 3)
        figures[f"{key}_captured"] = tally.ok
        figures[f"{key}_capture_failed"] = tally.failed
        gb = tally.raw_bytes / 1e9
        figures[f"{key}_cpu_s_per_gb"] = round(cpu / gb, 2) if gb else None
    print(f"[bench.serve] seed {seed} {arm.name} c={concurrency}: {figures[f'{key}_requests_per_s']} req/s",
          flush=True)
    return figures


def run_group(group: list[str], model: Path, prompts: dict[int, int], passes: int) -> list[dict[str, Any]]:
    """Up ``group``'s servers together, then ``passes`` passes of bursts: each
    pass's figures and ratios."""
    per_pass: list[dict[str, Any]] = []
    with ExitStack() as stack:
        broker = stack.enter_context(EmbeddedBroker())
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-serve-")))
        arms = [start_arm(name, model, tmp / name, broker, stack) for name in group]
        rss = round(sum(arm.server.rss_bytes() for arm in arms) / 2**30, 2)
        for arm in arms:
            warm_up(arm.url, model)
        for p in range(passes):
            order = arms[p % len(arms):] + arms[: p % len(arms)]
            figures: dict[str, Any] = {f"serve_group_{'_'.join(group)}_rss_gb": rss}
            for concurrency, count in prompts.items():
                for arm in order:
                    settle(arms)
                    figures.update(burst(arm, model, concurrency, count, seed=100 * p + concurrency))
            per_pass.append({**figures, **_ratios(figures, prompts)})
    return per_pass


def groups(arms: list[str]) -> list[list[str]]:
    """:data:`GROUPS` narrowed to ``arms`` (``plain`` always in), without a group another one covers."""
    narrowed = [["plain", *[a for a in g if a in arms and a != "plain"]] for g in GROUPS]
    unique = [g for i, g in enumerate(narrowed) if g not in narrowed[:i]]
    return [g for g in unique if not any(set(g) < set(other) for other in unique)]


def summarize(per_pass: list[dict[str, Any]],
              ratio_suffixes: tuple[str, ...] = tuple(f"_vs_{base}" for base in RATIO_BASES)) -> dict[str, Any]:
    """Medians over passes; a ratio (a key ending in one of ``ratio_suffixes``) also
    as its passes' values and a bootstrap interval."""
    results: dict[str, Any] = {}
    for key in per_pass[0]:
        values = [f[key] for f in per_pass if isinstance(f.get(key), int | float)]
        results[key] = round(statistics.median(values), 3) if values else None
        ratio = key.endswith(ratio_suffixes)
        if len(per_pass) > 1 and (ratio or key.endswith("_requests_per_s")):
            results[f"{key}_rounds"] = [f.get(key) for f in per_pass]
        if len(values) > 2 and ratio:
            results[f"{key}_ci95"] = _median_interval(values)
    return results


def pin(engine_cpus: set[int]) -> None:
    """The servers' OpenMP threads on ``engine_cpus`` (``VLLM_CPU_OMP_THREADS_BIND``,
    which the servers inherit), this process and every other one it starts (the
    load generator, vLLM's frontends and EngineCore, the broker, the sink) on the
    remaining cores, where there are any, so that nothing else is scheduled onto
    a core whose OpenMP thread a step's barrier waits for."""
    os.environ[BIND_ENV] = cpu_list(engine_cpus)
    others = os.sched_getaffinity(0) - engine_cpus
    if others:
        os.sched_setaffinity(0, others)


def main(args: Namespace) -> dict[str, Any]:
    model = models.prepare(names=[MODEL])[MODEL]
    pin(set(args.engine_cpus))
    scale = 0.25 if args.quick else args.burst_scale
    prompts = {c: int(BURST[c] * scale) for c in ([1, 8] if args.quick else args.concurrency)}
    passes = 1 if args.quick else args.rounds
    chosen = groups(args.arms)
    results: dict[str, Any] = {"serve_model": MODEL, "serve_layers": LAYERS, "serve_input_len": INPUT_LEN,
                               "serve_output_len": OUTPUT_LEN, "serve_prompts": {str(c): n for c, n in prompts.items()},
                               "serve_rounds": passes, "serve_arms": args.arms, "serve_groups": chosen,
                               "serve_engine_cpus": os.environ[BIND_ENV],
                               "serve_other_cpus": cpu_list(os.sched_getaffinity(0))}
    for group in chosen:  # an arm in two groups (plain, method) keeps its first group's figures
        for key, value in summarize(run_group(group, model, prompts, passes)).items():
            results.setdefault(key, value)
    add_worst(results)
    results["serve_capture_lag_p99_c8_s"] = max(
        (results.get(f"serve_{arm}_c8_capture_lag_p99_s") or 0.0) for arm in ("files", "kafka"))
    return results


def _median_interval(values: list[float], resamples: int = 10_000) -> list[float]:
    """A percentile-bootstrap 95 % interval of the median of ``values`` (fixed seed)."""
    rng = np.random.default_rng(0)
    medians = np.median(rng.choice(np.asarray(values), size=(resamples, len(values))), axis=1)
    return [round(float(q), 3) for q in np.percentile(medians, [2.5, 97.5])]


def add_worst(results: dict[str, Any]) -> None:
    """:data:`WORST`'s figures, from the per-concurrency ratios in ``results``."""
    for name, arms, base in WORST:
        key = _worst(results, tuple(f"serve_{arm}_" for arm in arms), f"_vs_{base}")
        results[name] = None if key is None else results[key]
        results[f"{name}_ci95"] = None if key is None else results.get(f"{key}_ci95")


def _worst(results: dict[str, Any], prefix: tuple[str, ...], suffix: str) -> str | None:
    """The key of the lowest of the ratios named ``<prefix>c<N><suffix>`` (None when there are none)."""
    keys = [k for k, v in results.items() if k.startswith(prefix) and k.endswith(suffix) and v is not None]
    return min(keys, key=results.__getitem__) if keys else None


def _ratios(figures: dict[str, Any], prompts: dict[int, int]) -> dict[str, float]:
    """One round's requests/s of each arm ÷ ``plain``'s (and ÷ ``plain_sync``'s, ``method``'s, ``stock``'s),
    per concurrency."""
    ratios: dict[str, float] = {}
    for arm in ARMS:
        for c in prompts:
            mine = figures.get(f"serve_{arm}_c{c}_requests_per_s")
            for base in RATIO_BASES:
                other = figures.get(f"serve_{base}_c{c}_requests_per_s")
                if mine and other and arm != base:
                    ratios[f"serve_{arm}_c{c}_vs_{base}"] = round(mine / other, 3)
    return ratios


if __name__ == "__main__":
    cli_parser = parser(__doc__)
    cli_parser.set_defaults(rounds=6)
    cli_parser.add_argument("--arms", nargs="+", choices=ARMS, default=ARMS,
                            help="the arms to run (default: all); plain is every ratio's base")
    cli_parser.add_argument("--concurrency", nargs="+", type=int, choices=CONCURRENCY, default=CONCURRENCY)
    cli_parser.add_argument("--burst-scale", type=int, default=1,
                            help="prompts a burst, as a multiple of the default (8 / 32 / 64 at c = 1 / 8 / 32): "
                                 "longer bursts average more of a shared machine's noise")
    cli_parser.add_argument("--engine-cpus", nargs="+", type=int, default=sorted(os.sched_getaffinity(0)),
                            help="the cores of the servers' OpenMP threads; the other cores run everything else "
                                 "(default: all cores, shared)")
    cli = cli_parser.parse_args()
    psutil.Process().cpu_percent()  # prime psutil's counters
    emit(main(cli), cli.out)
