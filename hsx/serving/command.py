"""``hsx serve --model M``: the seed's server in one command. vLLM's own
OpenAI-compatible server with ``extract_hidden_states`` and HsxConnector, every
response's hidden states as a file (``--shared-storage-path``), in a dataset
(``--output``), or both.

1. Check the arguments (model, layers, where captures go) before anything starts.
2. With ``--output``: the broker (``--bootstrap`` or ``HSX_KAFKA_BOOTSTRAP``, else
   the embedded one), topics, and an ``hsx sink`` child writing the dataset. With
   ``--no-sink`` instead: the cluster's blocks topic, for the sinks it already has.
3. The report channel (:mod:`hsx.serving.reports`): the connector reports every
   capture here; hsx's metrics (``--health-port``) and the summary count them.
4. vLLM's server as a child process (``python -m
   vllm.entrypoints.openai.api_server``, the seed's flags built from ours), the
   CPU defaults of ``hsx extract`` in its environment.
5. Print the endpoint; serve until SIGTERM or Ctrl-C (or the server exits).
6. Drain: SIGTERM to vLLM's server, which stops taking requests and answers
   those in flight (``--shutdown-timeout``); its connector finishes every
   capture before the engine exits (files unlocked, samples acknowledged by
   Kafka). A promise no report kept (the engine died instead) is lost. Then
   wait until the sink announced every acknowledged sample on
   ``hidden_states.ready`` (followed since step 2), and stop the sink.
7. Print the summary, name every lost capture; exit 0 when none was lost.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import signal
import sys
import tempfile
import threading
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from hsx.dataset.draft_store import DraftStore
from hsx.dataset.storage import is_object_store
from hsx.extractor.cli import add_model_arguments
from hsx.extractor.engine import EngineOptions, engine_speculative_config, kv_transfer_config
from hsx.local.spawn import HsxService, ServiceError, cpu_engine_env
from hsx.runtime.checks import integer, number
from hsx.runtime.errors import ExitCode
from hsx.runtime.health import HealthServer
from hsx.schemas.connector import DRAFTS_KEY, EXTRA_CONFIG_KEY, REPORTS_KEY
from hsx.schemas.dataset_codec import DatasetCodec
from hsx.serving.learning import Learning
from hsx.serving.pipeline import Drained, dataset_side
from hsx.serving.plan import ServePlan, plan_from_args
from hsx.serving.reports import ReportReceiver
from hsx.serving.rollbacks import Rollbacks
from hsx.serving.summary import summarize

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
    drafts = parser.add_argument_group("speculative decoding")
    drafts.add_argument("--draft", metavar="DIR",
                        help="serve with this EAGLE-3 draft (speculators' format, vLLM's eagle3 method) and capture "
                             "the verifier's states from the passes that verify it: the draft's aux layers and the "
                             "last, accepted tokens only (default: no draft, vLLM's extract_hidden_states)")
    drafts.add_argument("--num-speculative-tokens", type=integer(1), default=EngineOptions.num_speculative_tokens,
                        metavar="K",
                        help="draft tokens a step with --draft (default %(default)s)")
    drafts.add_argument("--drafts", metavar="DIR|s3://BUCKET/PREFIX",
                        help="with --draft: follow the drafts store's promoted.json (a directory, or an object store "
                             "a trainer promotes to) and swap each promoted draft in while serving, with no restart "
                             "(a checkpoint that does not fit is refused and the draft kept)")
    learning = parser.add_argument_group("learning from the traffic (with --draft and --output)")
    learning.add_argument("--learn", action="store_true",
                          help="train the draft on the served samples as they come (hsx train-draft --init-from the "
                               "served draft), judge each checkpoint on held-out samples and swap the better ones in")
    learning.add_argument("--save-path", metavar="DIR",
                          help="with --learn: checkpoints (DIR/trainer) and promoted drafts (DIR/drafts)")
    learning.add_argument("--trainer-python", metavar="PATH",
                          help="a Python with speculators and hsx (default: .venv-speculators/bin/python beside this "
                               "environment, as `make speculators` builds it)")
    learning.add_argument("--checkpoint-every", type=integer(1), default=50, metavar="N",
                          help="training steps per checkpoint, each judged by the gate (default %(default)s)")
    learning.add_argument("--margin", type=number(0), default=0.05,
                          help="acceptance length a checkpoint must gain to be promoted (default %(default)s)")
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


def server_argv(plan: ServePlan, extra: dict[str, Any]) -> list[str]:
    """vLLM's server flags: the seed's command, with no draft token a step
    (:mod:`hsx.extractor.no_draft_tokens`) and HsxConnector with ``extra`` as its
    ``kv_connector_extra_config``."""
    engine = plan.engine
    argv = ["--model", engine.model, "--host", plan.host, "--port", str(plan.port), "--dtype", engine.dtype,
            "--max-model-len", str(engine.max_model_len),
            "--tensor-parallel-size", str(engine.tensor_parallel_size),
            "--data-parallel-size", str(engine.data_parallel_size),
            "--speculative-config", json.dumps(engine_speculative_config(engine)),
            "--kv-transfer-config", json.dumps(kv_transfer_config(extra)),
            "--shutdown-timeout", str(plan.shutdown_timeout)]
    if engine.draft is not None:  # each sample records what vLLM counted of its own drafts
        argv += ["--per-request-spec-decode-metrics", "summary"]
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
        pipeline = stack.enter_context(dataset_side(plan, logs)) if plan.sends else None
        reports = (ReportReceiver(private, pipeline.announcements.acknowledged) if pipeline is not None
                   else ReportReceiver(private))
        stack.callback(reports.close)
        extra: dict[str, Any] = {REPORTS_KEY: reports.address}
        if plan.files is not None:
            extra.update(shared_storage_path=str(Path(plan.files).resolve()), files_ttl_s=plan.files_ttl,
                         files_max_bytes=plan.files_max_bytes)
        if pipeline is not None:
            extra[EXTRA_CONFIG_KEY] = pipeline.connector_config(plan)
        if plan.drafts is not None:
            extra[DRAFTS_KEY] = plan.drafts if is_object_store(plan.drafts) else str(Path(plan.drafts).resolve())
        server = _server(plan, extra, logs)
        stack.callback(lambda: server.exited() is None and server.kill())
        health = HealthServer(plan.health_port, ready=lambda: _answers(server, reports), host=plan.host).start()
        stack.callback(health.stop)
        try:
            ready = server.wait_ready(timeout=1800, stop=stop)  # False: Ctrl-C while it started, so the drain
        except ServiceError as exc:
            print(f"hsx serve: vLLM's server did not start: {exc}", file=sys.stderr)
            return ExitCode.FAILED
        started = time.monotonic()
        if ready:
            # Where a trainer follows the samples (hsx train-draft --bootstrap B --ready-topic T).
            announced = (f"; samples announced on {pipeline.topics.ready} at {pipeline.kafka.bootstrap}"
                         if pipeline is not None and pipeline.sink is not None else "")
            print(f"hsx serve: serving {plan.model_name or plan.engine.model} at http://{plan.host}:{plan.port}/v1 "
                  f"(hsx metrics at http://{plan.host}:{health.port}/metrics){announced}; Ctrl-C to stop",
                  file=sys.stderr, flush=True)
        store = DraftStore(plan.drafts) if plan.drafts is not None else None
        rollbacks = Rollbacks(store, str(plan.engine.draft)) if store is not None else None
        learning = None
        if ready and plan.learn is not None and store is not None and pipeline is not None and plan.output is not None:
            learning = Learning(plan.learn, store, str(plan.engine.draft), plan.engine.model, plan.output,
                                pipeline.kafka.bootstrap, pipeline.topics.ready, logs, accelerated=_accelerated())
            trainer = learning.trainer
            stack.callback(lambda: trainer.exited() is None and trainer.kill())
            print(f"hsx serve: learning: {trainer.log_path()}, drafts promoted to {plan.learn.drafts}",
                  file=sys.stderr, flush=True)
        while not stop.is_set() and server.exited() is None:
            stop.wait(0.5)
            if rollbacks is not None:
                rollbacks.check(reports.drafts, reports.acceptance)
            if learning is not None:
                learning.tick()
        failures = learning.stop() if learning is not None else []
        failures += server.drain(plan.shutdown_timeout + 120, "vLLM's server")  # step 6
        reports.close()
        drained = (pipeline.wait_announced(reports.samples.lost) if pipeline is not None
                   else Drained(unconfirmed=reports.samples.lost))
        reports.settle_samples(drained.unconfirmed)
        if pipeline is not None:
            failures += pipeline.stop()
        return summarize(plan, reports, drained, failures, time.monotonic() - started, learning, rollbacks)


def _accelerated() -> bool:
    import torch

    return torch.cuda.is_available()


def server_env(plan: ServePlan) -> dict[str, str]:
    """vLLM's server's environment: this one with the CPU defaults for its engine."""
    from hsx.extractor.cpu_defaults import apply_cpu_defaults

    # Into os.environ, which the child inherits. vLLM's server keeps its own executor (on CPU, a Worker
    # process): the defaults must not plan for a worker inside EngineCore, which only hsx extract sets up.
    executor = {**plan.engine.engine_args, "distributed_executor_backend": "mp"}
    apply_cpu_defaults(dataclasses.replace(plan.engine, engine_args=executor))
    return cpu_engine_env(**({"VLLM_API_KEY": plan.api_key} if plan.api_key else {}))


def _server(plan: ServePlan, extra: dict[str, Any], logs: Path) -> HsxService:
    """Step 4: vLLM's server, started, with the CPU defaults in its environment."""
    server = HsxService("vllm-server", server_argv(plan, extra), logs, env=server_env(plan), health=False,
                        module=SERVER, ready_path="/health", with_parent=True)
    server.port = plan.port
    return server.start()


def _answers(server: HsxService, reports: ReportReceiver) -> tuple[bool, str]:
    """hsx serve's readiness: vLLM's own ``/health``; the body also says when
    Kafka is behind (still ready: the server answers, slower once the in-flight
    budget is full, and loses nothing)."""
    if not server.ready():
        return False, "vLLM's server does not answer /health"
    return True, reports.kafka_condition() or "ok"
