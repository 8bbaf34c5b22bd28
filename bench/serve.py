"""vLLM's OpenAI server with and without capture, under vLLM's own load generator
(``vllm bench serve``'s code: ``vllm.benchmarks.serve``), in one run on one machine.

Arms, each a server started in turn with the same engine flags:

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

Each arm runs the random dataset (fixed seed) at concurrency 1, 8 and 32, in
``--rounds`` rounds (3; one with ``--quick``), the arms' order rotated each round
(several servers at once do not fit 2 cores: each arm starts and stops its own).
Each figure is the median over rounds; each ratio the median of the rounds' own
ratios (an arm against ``plain`` of the same round). Per arm
and concurrency: requests/s, output tokens/s, TTFT p50/p99 (vLLM's figures), capture
lag p50/p99 (from the connector's own report of each capture: the response's end
to the file complete or the sample acknowledged by Kafka; the bench receives the
reports as ``hsx serve`` does) and CPU-seconds of the server's process tree per GB
of hidden states captured. Ratios to ``plain`` at the same concurrency are the
figures to read; absolute numbers on a shared 2-core machine are noise.

    python -m bench.serve [--quick] [--rounds N] [--arms ARM ...] [--out FILE]
"""

from __future__ import annotations

import json
import shutil
import statistics
import tempfile
import time
from argparse import Namespace
from pathlib import Path
from typing import Any

import psutil

from bench.section import emit, parser
from hsx import models
from hsx.extractor.engine import kv_transfer_config, speculative_config
from hsx.local.broker import EmbeddedBroker
from hsx.local.commands import STEADY_SESSION_TIMEOUT_MS, sink_command
from hsx.local.spawn import HsxService, cpu_engine_env
from hsx.local.topics import fresh_topics
from hsx.runtime.settings import KafkaSettings
from hsx.schemas.connector import REPORTS_KEY
from hsx.serve import SERVER
from hsx.serve_reports import ReportReceiver, Tally

MODEL = "smollm2-135m-instruct"
LAYERS = [2, 15, 27, 30]
CONCURRENCY = [1, 8, 32]
INPUT_LEN, OUTPUT_LEN = 256, 16
ARMS = ["plain", "plain_sync", "drafts", "method", "stock", "files", "kafka"]


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
    env = cpu_engine_env(VLLM_CPU_KVCACHE_SPACE="2", VLLM_CPU_OMP_THREADS_BIND="0-1")
    return HsxService(name, args, work, env=env, module=SERVER, port_flag="--port", ready_path="/health")


def _load(url: str, model: Path, concurrency: int, prompts: int) -> dict[str, Any]:
    """One run of vLLM's load generator; its result dict."""
    from vllm.benchmarks.serve import add_cli_args, main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    cli = FlexibleArgumentParser()
    add_cli_args(cli)
    args = cli.parse_args([
        "--backend", "vllm", "--base-url", url, "--endpoint", "/v1/completions", "--model", str(model),
        "--dataset-name", "random", "--random-input-len", str(INPUT_LEN), "--random-output-len", str(OUTPUT_LEN),
        "--num-prompts", str(prompts), "--max-concurrency", str(concurrency), "--seed", "0", "--ignore-eos",
        "--percentile-metrics", "ttft,tpot,e2el", "--metric-percentiles", "50,99", "--disable-tqdm"])
    return main(args)  # type: ignore[no-any-return]


def run_arm(arm: str, model: Path, work: Path, prompts: dict[int, int], bootstrap: str) -> dict[str, Any]:
    figures: dict[str, Any] = {}
    reports = ReportReceiver(work) if arm in ("files", "kafka") else None
    extra: dict[str, Any] | None = None
    sink: HsxService | None = None
    if arm == "stock":
        extra = {"shared_storage_path": str(work / "files")}
    if reports is not None:
        extra = {"shared_storage_path": str(work / "files"), REPORTS_KEY: reports.address}
    if arm == "kafka":
        assert extra is not None
        topics = fresh_topics(KafkaSettings(bootstrap=bootstrap), partitions=2)
        extra["hsx"] = {"bootstrap": bootstrap, "blocks_topic": topics.blocks, "payload_store": str(work / "staging"),
                        "codec": "none"}
        sink = HsxService("sink", sink_command(bootstrap, topics, work / "dataset", "--flush-when-idle", "1",
                                               "--payload-store", str(work / "staging"),
                                               session_timeout_ms=STEADY_SESSION_TIMEOUT_MS), work).start()
    server = _server(arm, model, extra, work)
    with server:
        server.wait_ready(timeout=900)
        url = f"http://127.0.0.1:{server.port}"
        for concurrency, count in prompts.items():
            before_cpu = server.cpu_seconds()
            if reports is not None:
                reports.files, reports.samples = Tally(), Tally()
            result = _load(url, model, concurrency, count)
            time.sleep(1.0)  # the last captures' reports
            cpu = server.cpu_seconds() - before_cpu
            key = f"serve_{arm}_c{concurrency}"
            figures[f"{key}_requests_per_s"] = round(result["request_throughput"], 3)
            figures[f"{key}_output_tokens_per_s"] = round(result["output_throughput"], 2)
            figures[f"{key}_ttft_p50_ms"] = round(result["p50_ttft_ms"], 1)
            figures[f"{key}_ttft_p99_ms"] = round(result["p99_ttft_ms"], 1)
            figures[f"{key}_completed"] = result["completed"]
            figures[f"{key}_server_cpu_s"] = round(cpu, 2)
            if reports is not None:
                tally = reports.samples if arm == "kafka" else reports.files
                for name, q in (("p50", 0.5), ("p99", 0.99)):
                    lag = tally.lag_quantile(q)
                    figures[f"{key}_capture_lag_{name}_s"] = None if lag is None else round(lag, 3)
                figures[f"{key}_captured"] = tally.ok
                figures[f"{key}_capture_failed"] = tally.failed
                gb = tally.raw_bytes / 1e9
                figures[f"{key}_cpu_s_per_gb"] = round(cpu / gb, 2) if gb else None
            print(f"[bench.serve] {arm} c={concurrency}: {figures[f'{key}_requests_per_s']} req/s", flush=True)
    if sink is not None:
        sink.stop(timeout=120)
    if reports is not None:
        reports.close()
    return figures


def main(args: Namespace) -> dict[str, Any]:
    model = models.prepare(names=[MODEL])[MODEL]
    prompts = {c: (4 * c if args.quick else max(16, 4 * c)) for c in ([1, 8] if args.quick else CONCURRENCY)}
    rounds = 1 if args.quick else args.rounds
    results: dict[str, Any] = {"serve_model": MODEL, "serve_layers": LAYERS, "serve_input_len": INPUT_LEN,
                               "serve_output_len": OUTPUT_LEN, "serve_prompts": {str(c): n for c, n in prompts.items()},
                               "serve_rounds": rounds, "serve_arms": args.arms}
    per_round: list[dict[str, Any]] = []
    with EmbeddedBroker() as broker, tempfile.TemporaryDirectory(prefix="bench-serve-") as tmp:
        for r in range(rounds):
            figures: dict[str, Any] = {}
            for arm in args.arms[r % len(args.arms):] + args.arms[: r % len(args.arms)]:
                work = Path(tmp) / f"{arm}-{r}"
                work.mkdir()
                figures.update(run_arm(arm, model, work, prompts, broker.bootstrap))
                shutil.rmtree(work, ignore_errors=True)
            per_round.append({**figures, **_ratios(figures, prompts)})
    for key in per_round[0]:
        values = [f[key] for f in per_round if isinstance(f.get(key), int | float)]
        results[key] = round(statistics.median(values), 3) if values else None
        if rounds > 1 and key.endswith(("_vs_plain", "_vs_plain_sync", "_vs_method", "_vs_stock", "_requests_per_s")):
            results[f"{key}_rounds"] = [f.get(key) for f in per_round]
    results["serve_files_vs_stock_min"] = _worst(results, "serve_files_", "_vs_stock")
    results["serve_capture_vs_plain_min"] = _worst(results, ("serve_files_", "serve_kafka_"), "_vs_plain")
    results["serve_capture_vs_plain_sync_min"] = _worst(results, ("serve_files_", "serve_kafka_"), "_vs_plain_sync")
    results["serve_capture_vs_method_min"] = _worst(results, ("serve_files_", "serve_kafka_"), "_vs_method")
    results["serve_method_vs_plain_min"] = _worst(results, "serve_method_", "_vs_plain")
    results["serve_drafts_vs_plain_min"] = _worst(results, "serve_drafts_", "_vs_plain")
    results["serve_capture_lag_p99_c8_s"] = max(
        (results.get(f"serve_{arm}_c8_capture_lag_p99_s") or 0.0) for arm in ("files", "kafka"))
    return results


def _worst(results: dict[str, Any], prefix: str | tuple[str, ...], suffix: str) -> float | None:
    """The lowest of the ratios named ``<prefix>c<N><suffix>`` (None when there are none)."""
    values = [v for k, v in results.items() if k.startswith(prefix) and k.endswith(suffix) and v is not None]
    return min(values) if values else None


def _ratios(figures: dict[str, Any], prompts: dict[int, int]) -> dict[str, float]:
    """One round's requests/s of each arm ÷ ``plain``'s (and ÷ ``plain_sync``'s, ``method``'s, ``stock``'s),
    per concurrency."""
    ratios: dict[str, float] = {}
    for arm in ARMS:
        for c in prompts:
            mine = figures.get(f"serve_{arm}_c{c}_requests_per_s")
            for base in ("plain", "plain_sync", "method", "stock"):
                other = figures.get(f"serve_{base}_c{c}_requests_per_s")
                if mine and other and arm != base:
                    ratios[f"serve_{arm}_c{c}_vs_{base}"] = round(mine / other, 3)
    return ratios


if __name__ == "__main__":
    cli_parser = parser(__doc__)
    cli_parser.add_argument("--arms", nargs="+", choices=ARMS, default=ARMS,
                            help="the arms to run (default: all); plain is every ratio's base")
    cli = cli_parser.parse_args()
    psutil.Process().cpu_percent()  # prime psutil's counters
    emit(main(cli), cli.out)
