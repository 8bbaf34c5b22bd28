"""``hsx run INPUT --model M --output DIR``: the whole pipeline on one machine.

1. Check the local arguments (input, model directory, output) before anything starts.
2. The broker: ``--bootstrap`` or ``HSX_KAFKA_BOOTSTRAP``, else the embedded one.
3. Topics: the ``HSX_TOPIC_*`` names where given, else a fresh run-scoped set.
4. Resume: request ids already in the output's index are skipped.
5. Publish the input; with the first prompt to do, start the sink and the
   extractor as child processes, the same services as in production, without
   idle timeouts (an engine may take minutes to start). By default they pass
   hidden states by reference through a staging folder of the run's own
   (uncompressed for a raw dataset: :attr:`RunPlan.wire_codec`).
6. Follow ready events and dead letters until every published id is accounted
   for, with a progress bar fed by the extractor's metrics.
7. Drain both services (SIGTERM: flush, commit, leave), empty the run's
   staging folder and print the summary.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import get_args

import psutil
from tqdm import tqdm

from hsx.dataset.reader import Dataset
from hsx.dataset.storage import is_object_store, open_storage
from hsx.extractor.cli import add_model_arguments, as_argv, check_layout, model_and_layers
from hsx.running.ledger import Ledger, LedgerFeed
from hsx.local.broker import EmbeddedBroker
from hsx.local.commands import STEADY_SESSION_TIMEOUT_MS, extract_command, sink_command
from hsx.local.spawn import HsxService
from hsx.local.topics import fresh_topic_settings
from hsx.producer.cli import add_input_arguments, input_from_args
from hsx.producer.publisher import Publisher, PublishSummary
from hsx.runtime.checks import bounded, outside
from hsx.runtime.errors import ExitCode
from hsx.runtime.kafka import RecordProducer, ensure_topics
from hsx.runtime.kafka.admin import ONE_SHOT_CONNECT_TIMEOUT, add_connect_timeout
from hsx.runtime.settings import KafkaSettings, PromptLimitSettings, TopicSettings
from hsx.schemas import Topics, sample_id
from hsx.schemas.connector import WireDType
from hsx.schemas.dataset_codec import DatasetCodec
from hsx.running.plan import RunPlan
from hsx.summary import RunReport, render

LOST_AFTER_SECONDS = 120.0
"""Once the extractor has finished every prompt, how long the ready events and
dead letters of the rest may take before they count as lost."""
SINK_FLUSH_WHEN_IDLE = "2"
PLAIN_PROGRESS_SECONDS = 10.0
"""Off a terminal, how often the progress line is printed."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_input_arguments(parser)
    parser.add_argument("--output", required=True,
                        help="the dataset, resumed if it has one: a directory, or s3://BUCKET/PREFIX (AWS_* "
                             "environment, as for hsx sink; the services' logs then go to ./hsx-logs/PREFIX)")
    parser.add_argument("--bootstrap", help="a Kafka cluster (env HSX_KAFKA_BOOTSTRAP; default: an embedded broker)")
    add_connect_timeout(parser, ONE_SHOT_CONNECT_TIMEOUT, cluster="the cluster of --bootstrap")
    parser.add_argument("--partitions", type=bounded(TopicSettings, "partitions"), default=2,
                        help="partitions of run-scoped topics (default 2)")
    parser.add_argument("--dataset-codec", choices=[c.value for c in DatasetCodec], default=DatasetCodec.RAW.value,
                        help="how shards store hidden states, as hsx sink --dataset-codec (default raw)")
    parser.add_argument("--wire-dtype", choices=list(get_args(WireDType)), default="model",
                        help="what block records carry, as hsx extract --wire-dtype (default model: lossless)")
    transport = parser.add_mutually_exclusive_group()
    transport.add_argument("--payload-store", metavar="URL",
                           help="where the extractor stages hidden states for the sink, as hsx extract/sink "
                                "--payload-store: a directory or s3://BUCKET/PREFIX (default: a staging folder "
                                "beside the dataset, emptied when the run is done)")
    transport.add_argument("--inline", action="store_true",
                           help="send hidden states through Kafka as block records instead of staging them")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.set_defaults(model_actions=add_model_arguments(parser))


def run(args: argparse.Namespace) -> int:
    lines, mapping, on_invalid = input_from_args(args)
    check_layout(args)
    model_and_layers(args)  # the layer ids too: the extractor, a child process, would find them wrong only later
    if not is_object_store(args.output):
        outside("--output", args.output, "INPUT", args.file)  # a datasets directory as input
    forwarded = [a for a in args.model_actions if a.dest != "model"]
    plan = RunPlan(model=Path(args.model), output=args.output, lines=lines, mapping=mapping, on_invalid=on_invalid,
                   engine_argv=as_argv(forwarded, args), bootstrap=args.bootstrap, partitions=args.partitions,
                   progress=not args.no_progress, connect_timeout=args.connect_timeout,
                   dataset_codec=DatasetCodec(args.dataset_codec), wire_dtype=args.wire_dtype,
                   payload_store=args.payload_store, inline=args.inline)
    try:
        with stopping_children_on_interrupt():
            report = run_pipeline(plan)
    except KeyboardInterrupt:  # the services were killed; nothing unfinished was committed
        print(f"hsx run: interrupted; run the same command again to resume into {plan.output}", file=sys.stderr)
        return ExitCode.INTERRUPTED
    print(render(report.rows()))
    print(f"hsx run: {'done' if report.ok else 'FAILED'}; the dataset is in {plan.output}")
    return ExitCode.OK if report.ok else ExitCode.FAILED


def run_pipeline(plan: RunPlan) -> RunReport:
    """Steps 2-7 of the module docstring."""
    logs = plan.logs
    logs.mkdir(parents=True, exist_ok=True)
    existing = set(Dataset(open_storage(plan.output, create=True)).request_ids())
    staging = plan.staging
    transport = ["--payload-store", staging] if staging else []
    if plan.owns_staging:
        shutil.rmtree(staging, ignore_errors=True)  # an interrupted run's: no manifest of this run names them
    with broker(plan.bootstrap) as bootstrap:
        kafka = KafkaSettings(bootstrap=bootstrap)
        topic_settings = run_topics(plan.partitions)
        topics = topic_settings.topics()
        ensure_topics(kafka, topic_settings, [topics.prompts, topics.prompts_dlq, topics.blocks,
                                              topics.blocks_dlq, topics.ready], timeout=plan.connect_timeout)
        ledger = Ledger()
        feed = LedgerFeed.connect(kafka, topics, ledger)
        group = f"hsx-run-{uuid.uuid4().hex[:8]}"
        sink = HsxService("sink", sink_command(bootstrap, topic_settings, plan.output, "--flush-when-idle",
                                               SINK_FLUSH_WHEN_IDLE, "--dataset-codec", plan.dataset_codec.value,
                                               *transport, group=f"{group}-sink",
                                               session_timeout_ms=STEADY_SESSION_TIMEOUT_MS), logs, stats=True,
                          with_parent=True)
        codec = ["--codec", plan.wire_codec.value] if plan.wire_codec else []
        extractor = HsxService("extractor", extract_command(bootstrap, topic_settings, plan.model, *plan.engine_argv,
                                                            "--wire-dtype", plan.wire_dtype, *transport, *codec,
                                                            group=f"{group}-extractor", engine_flags=(),
                                                            session_timeout_ms=STEADY_SESSION_TIMEOUT_MS),
                               logs, stats=True, with_parent=True)
        started = time.monotonic()
        services = (sink, extractor)

        def sent(request_id: str) -> None:
            if not ledger.published:  # the first prompt to do: start the services (engine start overlaps publishing)
                for service in services:
                    service.start()
            ledger.published.add(sample_id(request_id))  # the id its ready event will carry

        failures: list[str] = []
        try:
            published = _publish(kafka, topics, plan, existing, sent)
            if ledger.published:
                failures = _watch_until_accounted(ledger, feed, extractor, sink, plan.progress)
                failures += _drain(extractor, sink)
                _settle(ledger, feed)
        finally:
            feed.close()
            for service in services:
                if service.proc is not None and service.exited() is None:
                    service.kill()
    extracted, sunk = ({} if s.proc is None else s.read_stats() for s in (extractor, sink))  # started this run
    if plan.owns_staging and not failures:
        shutil.rmtree(staging, ignore_errors=True)  # the sink deleted what it stored; the rest no manifest names
    return RunReport(plan.output, published, ledger, extracted, sunk, time.monotonic() - started, failures,
                     payload_store=staging)


@contextlib.contextmanager
def stopping_children_on_interrupt() -> Iterator[None]:
    """Inside, SIGTERM and SIGHUP (a closed terminal) interrupt as Ctrl-C does,
    and an interrupt kills every child process still left before it goes on
    (the services and the broker run in sessions of their own, so no signal
    reaches them but ours; the ordinary cleanup may itself have been cut short)."""

    def interrupt(_signum: int, _frame: object) -> None:
        raise KeyboardInterrupt

    previous = {sig: signal.signal(sig, interrupt) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    except KeyboardInterrupt:
        previous.setdefault(signal.SIGINT, signal.signal(signal.SIGINT, signal.SIG_IGN))  # a 2nd Ctrl-C waits
        for child in psutil.Process().children(recursive=True):
            with contextlib.suppress(psutil.Error):
                child.kill()
        raise
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


@contextlib.contextmanager
def broker(bootstrap: str | None) -> Iterator[str]:
    """``bootstrap``, else ``HSX_KAFKA_BOOTSTRAP``, else an embedded broker for as long as this lasts."""
    configured = bootstrap or os.environ.get("HSX_KAFKA_BOOTSTRAP")
    if configured:
        yield configured
        return
    with EmbeddedBroker(with_parent=True) as embedded:  # a killed hsx run or serve leaves no broker behind
        print(f"hsx: embedded broker at {embedded.bootstrap}", file=sys.stderr)
        yield embedded.bootstrap


def run_topics(partitions: int) -> TopicSettings:
    """The ``HSX_TOPIC_*`` names where any is set, else a run-scoped set."""
    if any(name.startswith("HSX_TOPIC_") for name in os.environ):
        return TopicSettings()
    return fresh_topic_settings(prefix="hsx-run.", partitions=partitions)


def _publish(kafka: KafkaSettings, topics: Topics, plan: RunPlan, existing: set[str],
             sent: Callable[[str], None]) -> PublishSummary:
    publisher = Publisher(RecordProducer.connect(kafka, "producer"), topics, plan.mapping,
                          PromptLimitSettings().limits(), plan.on_invalid)
    summary = publisher.publish(plan.lines, skip_ids=existing, on_sent=lambda event: sent(event.request_id))
    print(f"hsx run: {summary.describe()}", file=sys.stderr)
    return summary


def _watch_until_accounted(ledger: Ledger, feed: LedgerFeed, extractor: HsxService, sink: HsxService, progress: bool) -> list[str]:
    """Step 6: until every published id is accounted for, a service exits, or the
    extractor is done and the rest does not come within :data:`LOST_AFTER_SECONDS`."""
    total = len(ledger.published)
    first_token_at: float | None = None
    extracted_at: float | None = None
    # Off a terminal (a log file, CI) a bar redraws with carriage returns into one
    # endless line: a plain line every PLAIN_PROGRESS_SECONDS instead.
    plain = progress and not sys.stderr.isatty()
    last_line = time.monotonic()
    with tqdm(total=total, unit=" prompts", disable=not progress or plain, file=sys.stderr, mininterval=0.5) as bar:
        while ledger.accounted < total:
            for service in (extractor, sink):
                if service.exited() is not None:
                    return [f"{service.name} exited with {service.exited()} (log: {service.log_path()})"]
            feed.poll(0.5)
            done = extractor.metric("hsx_extractor_prompts_total") + extractor.metric(
                "hsx_extractor_dead_letters_total", labelled=True)
            tokens = extractor.metric("hsx_extractor_tokens_total")
            now = time.monotonic()
            if tokens > 0 and first_token_at is None:
                first_token_at = now
            bar.n = max(ledger.accounted, int(done) if done == done else 0)  # NaN while the engine starts
            rate = tokens / (now - first_token_at) if first_token_at and now > first_token_at else 0.0
            bar.set_postfix_str(f"{rate:.0f} tokens/s", refresh=False)
            bar.update(0)
            if plain and now - last_line >= PLAIN_PROGRESS_SECONDS:
                print(f"hsx run: {bar.n}/{total} prompts, {rate:.0f} tokens/s", file=sys.stderr, flush=True)
                last_line = now
            if done >= total and extracted_at is None:
                extracted_at = now
            if extracted_at is not None and now - extracted_at > LOST_AFTER_SECONDS:
                return []  # the rest is lost; the report says which
    return []


def _drain(extractor: HsxService, sink: HsxService) -> list[str]:
    """Step 7: SIGTERM each service (extractor first, so the sink sees every block)."""
    failures = []
    for service in (extractor, sink):
        if service.exited() is None:
            status = service.stop(timeout=300)
        else:
            status = service.exited()
        if status != 0:
            failures.append(f"{service.name} exited with {status} (log: {service.log_path()})")
    return failures


def _settle(ledger: Ledger, feed: LedgerFeed, seconds: float = 10.0) -> None:
    """The sink's drain publishes the ready events of its last shards: read them."""
    deadline = time.monotonic() + seconds
    while ledger.missing and time.monotonic() < deadline:
        feed.poll(0.5)
