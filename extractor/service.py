"""The extractor service: a consumer-group member on ``prompts`` that feeds vLLM.

Data flows one way: consume → validate and tokenize → prefill in vLLM → wait for
the connector's completion report (records acknowledged by Kafka) → mark the
offset done → commit the partition's watermark. Bad prompts go to the DLQ, whose
acknowledgement also counts as done, so a partition never stalls.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import tempfile
import time
from pathlib import Path

from confluent_kafka import Message
from pydantic import ValidationError

from hsx.extractor.attempts import Attempts
from hsx.extractor.backlog import Backlog
from hsx.extractor.completion import CompletionReceiver
from hsx.extractor.connector.kafka_settings import write_kafka_settings
from hsx.extractor.engine import Engine, EngineOptions
from hsx.extractor.model_config import text_config
from hsx.extractor.options import ExtractorOptions
from hsx.extractor.prompts import PromptPreparer, PromptRejected
from hsx.extractor.stats import ExtractorStats
from hsx.runtime.errors import ExitCode, InvalidInput, ServiceFailed, unexpected
from hsx.runtime.kafka import DeliveryFailed, RecordProducer, ensure_topics
from hsx.runtime.kafka.dead_letters import DeadLetters
from hsx.runtime.kafka.member import GroupMember
from hsx.runtime.kafka.watermarks import TopicPartitionKey
from hsx.runtime.settings import KafkaSettings, TopicSettings
from hsx.schemas import DEFAULT_LIMITS, ErrorClass, PromptEvent, PromptLimits, SourceRef, format_validation_error
from hsx.schemas.connector import ConnectorConfig

log = logging.getLogger(__name__)


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
        self.member = GroupMember(
            kafka, options.group_id, self.topics.prompts, "extractor", self,
            consumer_overrides={
                "session.timeout.ms": options.session_timeout_ms,
                "max.poll.interval.ms": max(600_000, int(options.completion_timeout * 2000)),
            },
            commit_interval=options.commit_interval, exit_when_idle=options.exit_when_idle,
            stall_timeout=options.stall_timeout,
        )
        self._tasks: set[asyncio.Task[None]] = set()
        self._backlog = Backlog(options.max_inflight)
        self._last_progress = time.monotonic()
        self._engine_ready = False

    async def run(self) -> ExtractorStats:
        """Run until stopped (SIGTERM/SIGINT, idle timeout); drain, commit, leave.
        Raises :class:`ServiceFailed` when it had to stop early."""
        self.member.handle_signals(self.stop)
        ensure_topics(self.kafka, self.topic_settings, [self.topics.prompts, self.topics.prompts_dlq, self.topics.blocks])
        self.member.serve_health(self.options.health_port, self._not_ready,
                                 lambda: f"{len(self._tasks)} prompts in flight, {len(self._backlog)} waiting")
        with tempfile.TemporaryDirectory(prefix="hsx-extractor-") as tmp:
            self._completions = CompletionReceiver(Path(tmp))
            self._completions.start()
            # The connector runs in vLLM's processes; its Kafka settings go in a private
            # file, not in its config, which vLLM logs (secrets stay out of the log).
            connector = self.connector.model_copy(update={
                "completion_address": self._completions.address,
                "kafka_settings_file": write_kafka_settings(self.kafka, Path(tmp)),
            })
            self._engine = Engine(self.engine_options, connector)
            self._engine_ready = True
            try:
                self._preparer = _preparer(self.engine_options)
                self._dead_letters = DeadLetters(RecordProducer.connect(self.kafka, "extractor", self._fail), "extractor")
                self._attempts = Attempts(self._engine, self._completions, self.stats,
                                          self.options.max_attempts, self.options.completion_timeout)
                self.member.subscribe()
                await self._consume_loop()
                await self._drain()
            finally:
                self._close()
                await self._completions.close()
        self.member.raise_if_failed()
        log.info("extractor finished: %s", self.stats.describe())
        return self.stats

    def stop(self) -> None:
        """Stop fetching; in-flight prompts finish, then the service commits and leaves.
        While the model still loads there is nothing to drain: the load is
        interrupted at once (exit 130) instead of finishing first."""
        if not self._engine_ready:
            _abandon_engine_start()
        log.info("stopping: draining %d in-flight prompts", len(self._tasks))
        self.member.stop()

    def _not_ready(self) -> str | None:
        return None if self._engine_ready else "loading the model"

    async def _consume_loop(self) -> None:
        member = self.member
        while not member.stopping:
            self._watch_engine()
            if member.stopping:
                break
            self._dead_letters.producer.poll(0)
            self._start_waiting()
            member.pause(self._backlog.should_pause(member.paused))
            messages = list(member.poll(max(1, self._backlog.room), timeout=0))
            self._backlog.add(messages)
            self._start_waiting()
            self.stats.in_flight(len(self._tasks), len(self._backlog))
            member.tick(busy=bool(self._tasks))
            await asyncio.sleep(0 if messages else 0.02)

    def _start_waiting(self) -> None:
        """Start waiting prompts, oldest first, while fewer than ``max_inflight`` run."""
        while len(self._tasks) < self.options.max_inflight and (message := self._backlog.take()) is not None:
            self._accept(message)

    # -- partitions come and go (PartitionHandler) ---------------------------------------------

    def assigned(self, partitions: list[TopicPartitionKey]) -> None:
        pass

    def revoked(self, partitions: list[TopicPartitionKey]) -> None:
        """Prompts already running finish (the next owner's copies are dropped by
        the sink as duplicates); waiting ones are left to the next owner."""
        self._backlog.drop(partitions)

    lost = revoked

    def _watch_engine(self) -> None:
        """A dead engine, or one that finishes nothing for ``stall_timeout`` with
        prompts in flight, is fatal: the orchestrator restarts the process."""
        if self._engine.dead:
            self._fail(ServiceFailed("the vLLM engine died (see its log above)"))
        elif self._tasks and time.monotonic() - self._last_progress > self.options.stall_timeout:
            self._fail(ServiceFailed(f"no prompt finished for {self.options.stall_timeout:.0f}s with "
                                     f"{len(self._tasks)} in flight: the engine looks stuck"))

    async def _drain(self) -> None:
        self.member.pause(True)
        if self._tasks and self.member.fatal is None:  # after a fatal error they would never finish
            await asyncio.wait(list(self._tasks), timeout=self.options.drain_timeout)
        try:
            self._dead_letters.producer.flush(30)
        except DeliveryFailed as exc:  # their records stay uncommitted; a restart re-rejects them
            self._fail(exc)
        self.member.commit()

    def _close(self) -> None:
        for task in self._tasks:
            task.cancel()
        self.member.close()
        self._engine.shutdown()

    def _fail(self, error: BaseException) -> None:
        """Stop without committing anything unfinished; a restart reprocesses it."""
        self.member.fail(error)
        self._completions.fail_all(error)

    # -- per record ---------------------------------------------------------------------------

    def _accept(self, message: Message) -> None:
        self.stats.consumed()
        if not self._tasks:  # the stall clock runs only while there is work
            self._last_progress = time.monotonic()
        task = asyncio.get_running_loop().create_task(self._process(message))
        self._tasks.add(task)
        task.add_done_callback(self._task_done)

    def _task_done(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        self._last_progress = time.monotonic()
        self.member.touch()
        if not task.cancelled() and task.exception() is not None:
            self._fail(task.exception())  # type: ignore[arg-type]

    async def _process(self, message: Message) -> None:
        source = SourceRef(topic=message.topic(), partition=message.partition(), offset=message.offset())
        try:
            event = PromptEvent.model_validate_json(message.value() or b"", context={"limits": self.limits})
            prepared = self._preparer.prepare(event)
        except ValidationError as exc:
            self._dead_letter(message, InvalidInput(ErrorClass.INVALID_EVENT, format_validation_error(exc)))
            return
        except PromptRejected as rejection:
            self._dead_letter(message, rejection)
            return
        except Exception as exc:  # the last line of defence: this record, not the service
            self._dead_letter(message, unexpected(exc, f"prompt {source.topic}-{source.partition}@{source.offset}"))
            return
        rejection = await self._attempts.extract(event, prepared, source)
        if rejection is None:
            self.member.done((source.topic, source.partition), source.offset)
        else:
            self._dead_letter(message, rejection)

    def _dead_letter(self, message: Message, rejection: InvalidInput) -> None:
        """Publish the original record to the DLQ; its offset is done once Kafka
        acknowledged the dead letter."""
        tp, offset = (message.topic(), message.partition()), message.offset()

        def acked() -> None:
            self.stats.add("dead_lettered", label=rejection.error_class.value)
            self.member.done(tp, offset)

        self._dead_letters.send(self.topics.prompts_dlq, rejection, message.value(), message.key(), acked,
                                source_topic=tp[0], source_partition=tp[1], source_offset=offset)


def _preparer(options: EngineOptions) -> PromptPreparer:
    from transformers import AutoTokenizer

    vocab_size = text_config(options.model).vocab_size
    return PromptPreparer(AutoTokenizer.from_pretrained(options.model), vocab_size, options.max_model_len)


def _abandon_engine_start() -> None:
    """A stop while vLLM starts its engine: nothing was consumed, so there is
    nothing to drain or commit. vLLM's start-up swallows KeyboardInterrupt and
    would finish loading first (minutes for a large model), so its processes are
    killed here (they hold nothing of ours) and the service exits at once with
    the interrupted code."""
    import psutil

    log.warning("stopping while the model loads: nothing consumed, nothing to drain")
    children = psutil.Process().children(recursive=True)
    for child in children:  # all at once, so none lives to report the others' deaths
        with contextlib.suppress(psutil.NoSuchProcess):
            child.kill()
    psutil.wait_procs(children, timeout=5)
    logging.shutdown()
    os._exit(ExitCode.INTERRUPTED)
