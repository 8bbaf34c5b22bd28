"""The extractor service: a consumer-group member on ``prompts`` that feeds vLLM.

Data flows one way: consume → validate and tokenize → prefill in vLLM → wait for
the connector's completion report (records acknowledged by Kafka) → mark the
offset done → commit the partition's watermark. Bad prompts go to the DLQ, whose
acknowledgement also counts as done, so a partition never stalls.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from confluent_kafka import Consumer, KafkaError, Message, TopicPartition
from pydantic import ValidationError

from extractor import metrics
from extractor.completion import CompletionReceiver
from extractor.engine import Engine, EngineOptions, text_config
from extractor.prompts import PreparedPrompt, PromptPreparer, PromptRejected
from runtime.watermarks import Watermarks
from runtime.kafka import consumer_config, ensure_topics, make_producer
from runtime.health import HealthServer
from runtime.logs import record_fields, redact
from runtime.kafka.commits import commit_watermarks, partition_lag
from runtime.settings import KafkaSettings, TopicSettings
from schemas import DEFAULT_LIMITS, DlqHeaders, PromptEvent, PromptLimits, SourceRef, format_validation_error
from schemas.connector import ConnectorConfig, RequestParams

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ExtractorOptions:
    group_id: str = "hsx-extractor"
    max_inflight: int = 64
    """Prompts consumed but not finished; beyond it partitions are paused."""
    max_attempts: int = 3
    completion_timeout: float = 600.0
    """Seconds to wait for the connector's report after vLLM's output."""
    commit_interval: float = 1.0
    session_timeout_ms: int = 10_000
    exit_when_idle: float | None = None
    """Stop after this many seconds with nothing to do (batch runs)."""
    drain_timeout: float = 300.0
    """On SIGTERM, how long in-flight prompts may take to finish."""
    stall_timeout: float = 600.0
    """With prompts in flight and none finished for this long, the engine is taken
    to be stuck: the service stops (exit 1) so its orchestrator restarts it;
    nothing unfinished was committed, so the restart reprocesses it."""
    health_port: int | None = None
    """Serve /healthz, /readyz and /metrics here (0: any free port; None: off)."""


@dataclass
class ExtractorStats:
    prompts_done: int = 0
    tokens: int = 0
    raw_bytes: int = 0
    compressed_bytes: int = 0
    dead_lettered: int = 0
    retries: int = 0
    first_prompt_at: float | None = None
    last_done_at: float | None = None

    @property
    def busy_seconds(self) -> float:
        """From the first prompt consumed to the last one acknowledged: the
        throughput window, without engine start-up or idle time."""
        if self.first_prompt_at is None or self.last_done_at is None:
            return 0.0
        return self.last_done_at - self.first_prompt_at

    def as_dict(self) -> dict[str, float]:
        seconds = self.busy_seconds
        return {
            "prompts": self.prompts_done,
            "tokens": self.tokens,
            "busy_seconds": round(seconds, 3),
            "tokens_per_second": round(self.tokens / seconds, 1) if seconds else 0.0,
            "raw_bytes": self.raw_bytes,
            "compressed_bytes": self.compressed_bytes,
            "dead_lettered": self.dead_lettered,
            "retries": self.retries,
        }

    def describe(self) -> str:
        d = self.as_dict()
        ratio = self.raw_bytes / self.compressed_bytes if self.compressed_bytes else 0.0
        return (
            f"{d['prompts']} prompts, {d['tokens']} tokens in {d['busy_seconds']:.1f}s "
            f"({d['tokens_per_second']:.0f} tokens/s), {self.raw_bytes} raw → {self.compressed_bytes} "
            f"compressed bytes ({ratio:.2f}x), {self.dead_lettered} dead-lettered, {self.retries} retries"
        )


class FatalError(RuntimeError):
    """The service cannot go on safely (engine dead, DLQ unreachable)."""


class Extractor:
    """One extractor process: Kafka consumer + vLLM engine + completion channel."""

    def __init__(
        self,
        kafka: KafkaSettings,
        topics: TopicSettings,
        engine_options: EngineOptions,
        connector: ConnectorConfig,
        options: ExtractorOptions = ExtractorOptions(),
        limits: PromptLimits = DEFAULT_LIMITS,
    ) -> None:
        self.kafka = kafka
        self.topic_settings = topics
        self.topics = topics.topics()
        self.engine_options = engine_options
        self.connector = connector
        self.options = options
        self.limits = limits
        self.stats = ExtractorStats()
        self._marks = Watermarks()
        self._tasks: set[asyncio.Task[None]] = set()
        self._stopping = asyncio.Event()
        self._fatal: BaseException | None = None
        self._last_activity = time.monotonic()
        self._last_progress = time.monotonic()
        self._paused = False
        self._engine_ready = False
        self.health: HealthServer | None = None

    # -- lifecycle ------------------------------------------------------------------------

    async def run(self) -> ExtractorStats:
        """Run until stopped (SIGTERM/SIGINT, idle timeout); drain, commit, leave."""
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.stop)
        ensure_topics(self.kafka, self.topic_settings, [self.topics.prompts, self.topics.prompts_dlq, self.topics.blocks])
        # The connector runs in vLLM's processes and reads Kafka settings from the
        # environment it inherits (secrets stay out of vLLM's logged config).
        os.environ["HSX_KAFKA_BOOTSTRAP"] = self.kafka.bootstrap
        if self.options.health_port is not None:
            self.health = HealthServer(self.options.health_port, self._readiness).start()
        with tempfile.TemporaryDirectory(prefix="hsx-extractor-") as tmp:
            self._completions = CompletionReceiver(Path(tmp))
            self._completions.start()
            connector = self.connector.model_copy(update={"completion_address": self._completions.address})
            self._engine = Engine(self.engine_options, connector)
            self._engine_ready = True
            try:
                self._preparer = _preparer(self.engine_options)
                self._dlq = make_producer(self.kafka)
                self._consumer = Consumer(
                    consumer_config(
                        self.kafka,
                        self.options.group_id,
                        **{
                            "session.timeout.ms": self.options.session_timeout_ms,
                            "max.poll.interval.ms": max(600_000, int(self.options.completion_timeout * 2000)),
                        },
                    )
                )
                self._consumer.subscribe(
                    [self.topics.prompts], on_assign=self._on_assign, on_revoke=self._on_revoke, on_lost=self._on_lost
                )
                await self._consume_loop()
                await self._drain()
            finally:
                self._close()
                await self._completions.close()
                if self.health is not None:
                    self.health.stop()
        if self._fatal is not None:
            raise FatalError(str(self._fatal)) from self._fatal
        log.info("extractor finished: %s", self.stats.describe())
        return self.stats

    def _readiness(self) -> tuple[bool, str]:
        if not self._engine_ready:
            return False, "loading the model"
        if not hasattr(self, "_consumer"):  # the probe may come between engine start and subscribe
            return False, "joining the consumer group"
        if self._stopping.is_set():
            return False, "draining"
        if not self._consumer.assignment():
            return False, "no partitions assigned"
        return True, f"ready: {len(self._tasks)} prompts in flight"

    def stop(self) -> None:
        """Stop fetching; in-flight prompts finish, then the service commits and leaves."""
        log.info("stopping: draining %d in-flight prompts", len(self._tasks))
        self._stopping.set()

    async def _consume_loop(self) -> None:
        last_commit = self._last_activity = time.monotonic()  # engine start-up is not idleness
        while not self._stopping.is_set():
            if self._engine.dead:
                self._fail(FatalError("the vLLM engine died (see its log above)"))
                break
            if self._tasks and time.monotonic() - self._last_progress > self.options.stall_timeout:
                self._fail(FatalError(f"no prompt finished for {self.options.stall_timeout:.0f}s with "
                                      f"{len(self._tasks)} in flight: the engine looks stuck"))
                break
            self._dlq.poll(0)
            self._apply_backpressure()
            room = max(1, self.options.max_inflight - len(self._tasks))
            messages = self._consumer.consume(num_messages=room, timeout=0)
            for message in messages:
                self._accept(message)
            metrics.IN_FLIGHT.set(len(self._tasks))
            if time.monotonic() - last_commit >= self.options.commit_interval:
                self._commit()
                for (topic, partition), lag in partition_lag(self._consumer).items():
                    metrics.LAG.labels(topic, str(partition)).set(lag)
                last_commit = time.monotonic()
            if self._idle_expired():
                log.info("idle for %.0fs: stopping", self.options.exit_when_idle)
                self._stopping.set()
            await asyncio.sleep(0 if messages else 0.02)

    async def _drain(self) -> None:
        self._consumer.pause(self._consumer.assignment())
        if self._tasks and self._fatal is None:  # after a fatal error they would never finish
            await asyncio.wait(list(self._tasks), timeout=self.options.drain_timeout)
        self._dlq.flush(30)
        self._commit()

    def _close(self) -> None:
        for task in self._tasks:
            task.cancel()
        if hasattr(self, "_consumer"):
            self._consumer.close()  # leaves the group: partitions move on at once
        self._engine.shutdown()

    def _idle_expired(self) -> bool:
        idle = self.options.exit_when_idle
        return idle is not None and not self._tasks and time.monotonic() - self._last_activity >= idle

    # -- consumer-group callbacks ------------------------------------------------------------

    def _on_assign(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        log.info("assigned %s", [(p.topic, p.partition) for p in partitions])
        metrics.REBALANCES.labels("assign").inc()
        self._last_activity = time.monotonic()
        if self._paused:
            consumer.pause(partitions)

    def _on_revoke(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        """Commit what is finished of the revoked partitions, never past unfinished
        work; prompts still running for them finish but are not committed here
        (the new owner reprocesses them; the sink drops the duplicates)."""
        log.info("revoked %s", [(p.topic, p.partition) for p in partitions])
        metrics.REBALANCES.labels("revoke").inc()
        revoked = {(p.topic, p.partition) for p in partitions}
        self._commit(only=revoked)
        for tp in revoked:
            self._marks.forget(tp)

    def _on_lost(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        log.warning("lost %s without a chance to commit", [(p.topic, p.partition) for p in partitions])
        for p in partitions:
            self._marks.forget((p.topic, p.partition))

    # -- per record -----------------------------------------------------------------------------

    def _apply_backpressure(self) -> None:
        full = len(self._tasks) >= self.options.max_inflight
        if full != self._paused:
            assignment = self._consumer.assignment()
            (self._consumer.pause if full else self._consumer.resume)(assignment)
            self._paused = full

    def _accept(self, message: Message) -> None:
        error = message.error()
        if error is not None:
            if error.code() != KafkaError._PARTITION_EOF:
                log.warning("consumer error: %s", error)
            return
        self._last_activity = time.monotonic()
        if self.stats.first_prompt_at is None:
            self.stats.first_prompt_at = self._last_activity
        self._marks.track((message.topic(), message.partition()), message.offset())
        if not self._tasks:  # the stall clock runs only while there is work
            self._last_progress = self._last_activity
        task = asyncio.get_running_loop().create_task(self._process(message))
        self._tasks.add(task)
        task.add_done_callback(self._task_done)

    def _task_done(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        self._last_activity = self._last_progress = time.monotonic()
        if not task.cancelled() and task.exception() is not None:
            self._fail(task.exception())  # type: ignore[arg-type]

    def _fail(self, error: BaseException) -> None:
        """Stop without committing anything unfinished; a restart reprocesses it."""
        if self._fatal is None:
            self._fatal = error
            log.error("fatal: %s", error)
        self._stopping.set()
        self._completions.fail_all(error)

    async def _process(self, message: Message) -> None:
        source = SourceRef(topic=message.topic(), partition=message.partition(), offset=message.offset())
        try:
            event = PromptEvent.model_validate_json(message.value() or b"", context={"limits": self.limits})
        except ValidationError as exc:
            self._dead_letter(message, "invalid_event", format_validation_error(exc))
            return
        try:
            prepared = self._preparer.prepare(event)
        except PromptRejected as exc:
            self._dead_letter(message, exc.error_class, str(exc))
            return
        error = await self._extract(event, prepared, source)
        if error is None:
            self._done(source)
        else:
            self._dead_letter(message, *error)

    async def _extract(
        self, event: PromptEvent, prepared: PreparedPrompt, source: SourceRef
    ) -> tuple[str, str] | None:
        """Run attempts until one is acknowledged; returns ``None`` on success or
        the (rule, reason) to dead-letter with."""
        from vllm.v1.engine.exceptions import EngineDeadError

        reason = "no attempt made"
        for attempt in range(1, self.options.max_attempts + 1):
            params = RequestParams(
                request_id=event.request_id,
                attempt_id=uuid.uuid4().hex,
                source=source,
                loss_mask_spans=prepared.loss_mask_spans,
                metadata=event.metadata,
            )
            future = self._completions.expect(params.attempt_id)
            try:
                await self._engine.prefill(prepared.token_ids, params)
                report = await asyncio.wait_for(future, self.options.completion_timeout)
            except (EngineDeadError, FatalError):
                raise
            except ValueError as exc:  # vLLM's input validation: retrying cannot help
                self._completions.forget(params.attempt_id)
                return "engine_rejected", f"vLLM rejected the prompt: {exc}"
            except (asyncio.TimeoutError, Exception) as exc:  # noqa: BLE001 - retried, then dead-lettered
                self._completions.forget(params.attempt_id)
                reason = f"attempt {attempt}: {exc!r}"
            else:
                if report.ok:
                    self.stats.prompts_done += 1
                    self.stats.tokens += report.num_tokens
                    self.stats.raw_bytes += report.raw_bytes
                    self.stats.compressed_bytes += report.compressed_bytes
                    self.stats.last_done_at = time.monotonic()
                    metrics.PROMPTS.inc()
                    metrics.TOKENS.inc(report.num_tokens)
                    metrics.RAW_BYTES.inc(report.raw_bytes)
                    metrics.COMPRESSED_BYTES.inc(report.compressed_bytes)
                    return None
                reason = f"attempt {attempt}: {report.error}"
            log.warning("extraction of %s failed (%s)%s", event.request_id, reason,
                        "; retrying" if attempt < self.options.max_attempts else "",
                        extra=record_fields(event.request_id, source.topic, source.partition, source.offset))
            if attempt < self.options.max_attempts:
                self.stats.retries += 1
                metrics.RETRIES.inc()
        return "extraction_failed", reason

    def _done(self, source: SourceRef) -> None:
        self._marks.done((source.topic, source.partition), source.offset)

    def _dead_letter(self, message: Message, error_class: str, reason: str) -> None:
        """Publish the original record to the DLQ; its offset is done once Kafka
        acknowledged the dead letter."""
        log.warning("dead-lettering %s/%d@%d: %s: %s", message.topic(), message.partition(), message.offset(),
                    error_class, reason, extra=record_fields(
                        (message.key() or b"").decode("utf-8", "replace") or None, message.topic(),
                        message.partition(), message.offset()))
        headers = DlqHeaders.build(
            error_class, redact(reason), service="extractor", source_topic=message.topic(),
            source_partition=message.partition(), source_offset=message.offset(),
        )
        source = SourceRef(topic=message.topic(), partition=message.partition(), offset=message.offset())

        def delivered(err: KafkaError | None, _msg: Message) -> None:
            if err is None:
                self.stats.dead_lettered += 1
                metrics.DEAD_LETTERS.labels(error_class).inc()
                self._done(source)
            else:
                # Never commit past a record we could not account for.
                self._fail(FatalError(f"dead-letter topic unreachable: {err.str()}"))

        self._dlq.produce(
            self.topics.prompts_dlq, value=message.value(), key=message.key(), headers=headers.to_kafka(),
            on_delivery=delivered,
        )

    def _commit(self, only: set[tuple[str, int]] | None = None) -> None:
        with metrics.COMMIT_SECONDS.time():
            commit_watermarks(self._consumer, self._marks, only)


def _preparer(options: EngineOptions) -> PromptPreparer:
    from transformers import AutoTokenizer

    vocab_size = text_config(options.model).vocab_size
    return PromptPreparer(AutoTokenizer.from_pretrained(options.model), vocab_size, options.max_model_len)
