"""``hsx serve --model M``: the seed's server in one command. vLLM's own
OpenAI-compatible server with ``extract_hidden_states`` and HsxConnector, every
response's hidden states as a file (``--shared-storage-path``), in a dataset
(``--output``), or both.

1. Check the arguments (model, layers, where captures go) before anything starts.
2. With ``--output``: the broker (``--bootstrap`` or ``HSX_KAFKA_BOOTSTRAP``, else
   the embedded one), topics, and an ``hsx sink`` child writing the dataset. With
   ``--no-sink`` instead: the cluster's blocks topic, for the sinks it already has.
3. The report channel (:mod:`hsx.serve_reports`): the connector reports every
   capture here; hsx's metrics (``--health-port``) and the summary count them.
4. vLLM's server as a child process (``python -m
   vllm.entrypoints.openai.api_server``, the seed's flags built from ours), the
   CPU defaults of ``hsx extract`` in its environment.
5. Print the endpoint; serve until SIGTERM or Ctrl-C (or the server exits).
6. Drain: SIGTERM to vLLM's server, which stops taking requests and answers
   those in flight (``--shutdown-timeout``); its connector finishes every
   capture before the engine exits (files unlocked, samples acknowledged by
   Kafka). Then wait until the sink announced every acknowledged sample on
   ``hidden_states.ready``, and stop the sink.
7. Print the summary; exit 0 when no capture was lost.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hsx.dataset.storage import is_object_store
from hsx.extractor.cli import add_model_arguments, check_layout, model_and_layers
from hsx.extractor.engine import EngineOptions, kv_transfer_config, speculative_config
from hsx.ledger import Ledger, LedgerFeed
from hsx.local.commands import STEADY_SESSION_TIMEOUT_MS, sink_command
from hsx.local.spawn import HsxService, ServiceError, cpu_engine_env
from hsx.run import SINK_FLUSH_WHEN_IDLE, broker, run_topics
from hsx.run_plan import own_staging_codec
from hsx.runtime.checks import integer, model_dir, number, writable_dir
from hsx.runtime.errors import ExitCode, UsageError
from hsx.runtime.health import HealthServer
from hsx.runtime.kafka import ensure_topics
from hsx.runtime.settings import KafkaSettings, TopicSettings, from_args
from hsx.schemas.connector import EXTRA_CONFIG_KEY, REPORTS_KEY
from hsx.schemas.dataset_codec import DatasetCodec
from hsx.serve_reports import ReportReceiver, Tally
from hsx.summary import render

ANNOUNCE_SECONDS = 120.0
"""After the server stopped, how long the sink may take to announce the samples
Kafka acknowledged before the rest counts as lost."""
SERVER = "vllm.entrypoints.openai.api_server"
"""vLLM's OpenAI server: the CPU wheel's ``vllm serve`` (whose CLI does not start there)."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.set_defaults(model_actions=add_model_arguments(parser))
    server = parser.add_argument_group("server")
    server.add_argument("--host", default="127.0.0.1", help="address to bind (default %(default)s: this machine only)")
    server.add_argument("--port", type=int, default=8000, help="the OpenAI API's port (default %(default)s)")
    server.add_argument("--api-key", help="clients must send it as a bearer token (env VLLM_API_KEY)")
    server.add_argument("--health-port", type=int, default=None,
                        help="hsx's probes (/healthz; /readyz: vLLM's server answers) and Prometheus metrics "
                             "(default: --port + 1; vLLM's own stay on --port)")
    server.add_argument("--shutdown-timeout", type=int, default=60,
                        help="seconds requests in flight may take to finish after SIGTERM (default %(default)s)")
    captures = parser.add_argument_group("where hidden states go (one or both)")
    captures.add_argument("--shared-storage-path", metavar="DIR",
                          help="a safetensors file per response, named in its kv_transfer_params.hidden_states_path "
                               "(vLLM's stock hidden-states connector's contract)")
    captures.add_argument("--files-ttl", type=number(above=0), default=3600.0, metavar="SECONDS",
                          help="files no reader deleted are deleted after this (default %(default)s)")
    captures.add_argument("--files-max-bytes", type=integer(1 << 20), default=16 << 30, metavar="BYTES",
                          help="files kept at most; past it captures are refused, requests still answered "
                               "(default 16 GiB)")
    captures.add_argument("--output", help="the dataset every response's hidden states join: a directory or "
                                           "s3://BUCKET/PREFIX; the response's kv_transfer_params.sample_id names it")
    captures.add_argument("--bootstrap", help="a Kafka cluster for --output (env HSX_KAFKA_BOOTSTRAP; default: an "
                                              "embedded broker and an hsx sink started here)")
    captures.add_argument("--no-sink", action="store_true",
                          help="send to the cluster's blocks topic (HSX_TOPIC_BLOCKS) for the hsx sinks consuming it, "
                               "instead of starting a sink for --output (a deployment: k8s/components/serving)")
    captures.add_argument("--dataset-codec", choices=[c.value for c in DatasetCodec], default=DatasetCodec.RAW.value,
                          help="how shards store hidden states, as hsx sink --dataset-codec (default raw)")
    captures.add_argument("--inline", action="store_true",
                          help="hidden states through Kafka as block records (default for an s3:// output; a local "
                               "output stages them in OUTPUT/staging)")


@dataclass
class ServePlan:
    """What ``hsx serve`` needs, checked before anything starts (step 1)."""

    engine: EngineOptions
    host: str
    port: int
    health_port: int
    shutdown_timeout: int
    files: str | None
    files_ttl: float
    files_max_bytes: int
    output: str | None
    bootstrap: str | None
    own_sink: bool
    """Whether the dataset side starts a sink of its own (``--output``) or only
    sends to the cluster's sinks (``--no-sink``)."""
    dataset_codec: DatasetCodec
    inline: bool
    model_name: str | None
    api_key: str | None

    @property
    def sends(self) -> bool:
        """Whether responses' hidden states go to Kafka (the dataset side)."""
        return self.output is not None or not self.own_sink

    @property
    def staging(self) -> str | None:
        """Where the connector stages hidden states for the sink; ``None``: inline."""
        if self.output is None or self.inline or is_object_store(self.output):
            return None
        return str(Path(self.output) / "staging")

    @property
    def logs(self) -> Path:
        if self.output is not None and not is_object_store(self.output):
            return Path(self.output) / "logs"
        return Path("hsx-logs") / "serve"


def plan_from_args(args: argparse.Namespace) -> ServePlan:
    """Step 1: every local argument checked; ``UsageError`` in one line."""
    if args.shared_storage_path is None and args.output is None and not args.no_sink:
        raise UsageError("give --shared-storage-path DIR (a file per response), --output DATASET, or both")
    if args.no_sink and args.output is not None:
        raise UsageError("--no-sink sends to the cluster's sinks, which write their own dataset: drop --output")
    if args.no_sink and not (args.bootstrap or os.environ.get("HSX_KAFKA_BOOTSTRAP")):
        raise UsageError("--no-sink needs the cluster: --bootstrap or HSX_KAFKA_BOOTSTRAP")
    check_layout(args)
    model_dir("--model", Path(args.model))
    _config, layers = model_and_layers(args)
    if args.shared_storage_path is not None:
        writable_dir("--shared-storage-path", Path(args.shared_storage_path))
    if args.output is not None and not is_object_store(args.output):
        writable_dir("--output", Path(args.output))
    engine = from_args(EngineOptions, args, layer_ids=layers, engine_args=dict(args.engine_arg))
    return ServePlan(engine=engine, host=args.host, port=args.port,
                     health_port=args.health_port if args.health_port is not None else args.port + 1,
                     shutdown_timeout=args.shutdown_timeout, files=args.shared_storage_path,
                     files_ttl=args.files_ttl, files_max_bytes=args.files_max_bytes, output=args.output,
                     bootstrap=args.bootstrap, own_sink=not args.no_sink,
                     dataset_codec=DatasetCodec(args.dataset_codec), inline=args.inline,
                     model_name=args.model_name, api_key=args.api_key or os.environ.get("VLLM_API_KEY"))


def server_argv(plan: ServePlan, extra: dict[str, Any]) -> list[str]:
    """vLLM's server flags: the seed's command, with HsxConnector and ``extra``
    as its ``kv_connector_extra_config``."""
    engine = plan.engine
    argv = ["--model", engine.model, "--host", plan.host, "--port", str(plan.port), "--dtype", engine.dtype,
            "--max-model-len", str(engine.max_model_len),
            "--tensor-parallel-size", str(engine.tensor_parallel_size),
            "--data-parallel-size", str(engine.data_parallel_size),
            "--speculative-config", json.dumps(speculative_config(engine.layer_ids)),
            "--kv-transfer-config", json.dumps(kv_transfer_config(extra)),
            "--shutdown-timeout", str(plan.shutdown_timeout)]
    if plan.model_name:
        argv += ["--served-model-name", plan.model_name]
    if engine.enforce_eager:
        argv.append("--enforce-eager")
    for flag, value in (("--max-num-seqs", engine.max_num_seqs),
                        ("--max-num-batched-tokens", engine.max_num_batched_tokens)):
        if value is not None:
            argv += [flag, str(value)]
    for key, value in engine.engine_args.items():
        argv += [f"--{key.replace('_', '-')}", value if isinstance(value, str) else json.dumps(value)]
    return argv


def run(args: argparse.Namespace) -> int:
    plan = plan_from_args(args)
    stop = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        return serve(plan, stop)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def serve(plan: ServePlan, stop: threading.Event) -> int:
    """Steps 2-7; returns the exit status."""
    logs = plan.logs
    logs.mkdir(parents=True, exist_ok=True)
    with ExitStack() as stack:
        private = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="hsx-serve-")))
        reports = ReportReceiver(private)
        stack.callback(reports.close)
        extra: dict[str, Any] = {REPORTS_KEY: reports.address}
        if plan.files is not None:
            extra.update(shared_storage_path=str(Path(plan.files).resolve()), files_ttl_s=plan.files_ttl,
                         files_max_bytes=plan.files_max_bytes)
        pipeline = stack.enter_context(_pipeline(plan, logs)) if plan.sends else None
        if pipeline is not None:
            extra[EXTRA_CONFIG_KEY] = pipeline.connector_config(plan)
        server = _server(plan, extra, logs)
        stack.callback(lambda: server.exited() is None and server.kill())
        health = HealthServer(plan.health_port, ready=lambda: _answers(server), host=plan.host).start()
        stack.callback(health.stop)
        started = time.monotonic()
        if not _wait_ready(server, stop):
            print(f"hsx serve: vLLM's server did not start (exit {server.exited()}); its log: "
                  f"{server.log_path()}\n{server.log_tail()}", file=sys.stderr)
            return ExitCode.FAILED
        print(f"hsx serve: serving {plan.model_name or plan.engine.model} at http://{plan.host}:{plan.port}/v1 "
              f"(hsx metrics at http://{plan.host}:{health.port}/metrics); Ctrl-C to stop", file=sys.stderr,
              flush=True)
        while not stop.is_set() and server.exited() is None:
            stop.wait(0.5)
        failures = _stop_server(server, plan)
        reports.close()
        missing = pipeline.wait_announced(reports.sent_samples()) if pipeline is not None else set()
        if pipeline is not None:
            failures += pipeline.stop()
        print(render(_rows(plan, reports.files, reports.samples, missing, time.monotonic() - started)), flush=True)
        lost = reports.files.failed + reports.samples.failed + len(missing)
        ok = not failures and not lost
        for failure in failures:
            print(f"hsx serve: {failure}", file=sys.stderr)
        print(f"hsx serve: {'stopped' if ok else 'stopped with LOST captures'}", file=sys.stderr)
        return ExitCode.OK if ok else ExitCode.FAILED


def _server(plan: ServePlan, extra: dict[str, Any], logs: Path) -> HsxService:
    """Step 4: vLLM's server, started, with the CPU defaults in its environment."""
    from hsx.extractor.cpu_defaults import apply_cpu_defaults

    # Into os.environ, which the child inherits. vLLM's server keeps its own executor (on CPU, a Worker
    # process): the defaults must not plan for a worker inside EngineCore, which only hsx extract sets up.
    executor = {**plan.engine.engine_args, "distributed_executor_backend": "mp"}
    apply_cpu_defaults(dataclasses.replace(plan.engine, engine_args=executor))
    env = cpu_engine_env(**({"VLLM_API_KEY": plan.api_key} if plan.api_key else {}))
    server = HsxService("vllm-server", server_argv(plan, extra), logs, env=env, health=False, module=SERVER,
                        ready_path="/health")
    server.port = plan.port
    return server.start()


def _answers(server: HsxService) -> tuple[bool, str]:
    """hsx serve's readiness: vLLM's own ``/health``."""
    ok = server.ready()
    return ok, "ok" if ok else "vLLM's server does not answer /health"


def _wait_ready(server: HsxService, stop: threading.Event, timeout: float = 1800) -> bool:
    deadline = time.monotonic() + timeout
    while not server.ready():
        if server.exited() is not None or stop.is_set() or time.monotonic() > deadline:
            return False
        time.sleep(0.5)
    return True


def _stop_server(server: HsxService, plan: ServePlan) -> list[str]:
    """Step 6, the server's part: SIGTERM, and its exit within the drain's time."""
    if server.exited() is not None:
        return [f"vLLM's server exited with {server.exited()} (log: {server.log_path()})"]
    try:
        status = server.stop(timeout=plan.shutdown_timeout + 120)
    except ServiceError as exc:
        return [str(exc).splitlines()[0]]
    return [] if status == 0 else [f"vLLM's server exited with {status} on SIGTERM (log: {server.log_path()})"]


class _Pipeline:
    """The dataset side: a broker's topics and the sink writing ``--output`` (or,
    with ``--no-sink``, the cluster's blocks topic alone)."""

    def __init__(self, bootstrap: str, plan: ServePlan, logs: Path) -> None:
        self.kafka = KafkaSettings(bootstrap=bootstrap)
        self.topic_settings = run_topics(partitions=2) if plan.own_sink else TopicSettings()
        self.topics = self.topic_settings.topics()
        self.sink: HsxService | None = None
        self.feed: LedgerFeed | None = None
        self.ledger = Ledger()
        if plan.output is None:  # --no-sink
            ensure_topics(self.kafka, self.topic_settings, [self.topics.blocks])
            return
        ensure_topics(self.kafka, self.topic_settings, [self.topics.blocks, self.topics.blocks_dlq, self.topics.ready,
                                                        self.topics.prompts_dlq])
        transport = ["--payload-store", plan.staging] if plan.staging else []
        self.sink = HsxService("sink", sink_command(bootstrap, self.topic_settings, plan.output, "--flush-when-idle",
                                                    SINK_FLUSH_WHEN_IDLE, "--dataset-codec", plan.dataset_codec.value,
                                                    *transport, group=f"hsx-serve-{uuid.uuid4().hex[:8]}-sink",
                                                    session_timeout_ms=STEADY_SESSION_TIMEOUT_MS), logs).start()
        self.feed = LedgerFeed(self.kafka, self.topics, self.ledger)

    def connector_config(self, plan: ServePlan) -> dict[str, Any]:
        """The connector's Kafka side (``kv_connector_extra_config.hsx``)."""
        config: dict[str, Any] = {"bootstrap": self.kafka.bootstrap, "blocks_topic": self.topics.blocks}
        if plan.staging is not None:
            config["payload_store"] = plan.staging
            if (codec := own_staging_codec(plan.dataset_codec)) is not None:
                config["codec"] = codec.value
        if plan.model_name:
            config["model"] = plan.model_name
        return config

    def wait_announced(self, sent: set[str]) -> set[str]:
        """Step 6, the sink's part: the acknowledged samples it has not announced
        within :data:`ANNOUNCE_SECONDS` (or before it exited)."""
        if self.sink is None or self.feed is None:
            return set()  # the cluster's sinks announce them
        self.ledger.published = set(sent)
        deadline = time.monotonic() + ANNOUNCE_SECONDS
        while self.ledger.missing and time.monotonic() < deadline and self.sink.exited() is None:
            self.feed.poll(0.5)
        return self.ledger.missing

    def stop(self) -> list[str]:
        if self.sink is None or self.feed is None:
            return []
        self.feed.close()
        status = self.sink.stop(timeout=300) if self.sink.exited() is None else self.sink.exited()
        return [] if status == 0 else [f"sink exited with {status} (log: {self.sink.log_path()})"]


@contextmanager
def _pipeline(plan: ServePlan, logs: Path) -> Iterator[_Pipeline]:
    with broker(plan.bootstrap) as bootstrap:
        pipeline = _Pipeline(bootstrap, plan, logs)
        try:
            yield pipeline
        finally:
            if pipeline.sink is not None and pipeline.sink.exited() is None:
                pipeline.sink.kill()


def _rows(plan: ServePlan, files: Tally, samples: Tally, missing: set[str], seconds: float) -> list[tuple[str, str]]:
    """The summary table's rows."""
    rows = [("served for", f"{seconds:,.0f} s")]
    for name, tally, on in (("files", files, plan.files is not None), ("samples", samples, plan.sends)):
        if not on:
            continue
        p50, p99 = tally.lag_quantile(0.5), tally.lag_quantile(0.99)
        rows += [(f"{name} captured", f"{tally.ok:,} ({tally.raw_bytes:,} raw bytes)"),
                 (f"{name} lost", f"{tally.failed:,}" + (f": {tally.errors[0]}" if tally.errors else "")),
                 (f"{name} capture lag p50 / p99", "-" if p50 is None else f"{p50:.3f} / {p99:.3f} s")]
    if plan.output is not None:
        rows += [("samples not announced", f"{len(missing):,}"), ("dataset", plan.output)]
    if plan.files is not None:
        rows.append(("files in", plan.files))
    return rows
