"""The sink service: a consumer-group member on ``hidden_states.blocks``.

Data flows one way: consume → reassemble and verify samples (per partition) →
append to the partition's open shard → when the shard closes, write it durably,
then its index, then publish one ``hidden_states.ready`` event per sample → once
Kafka acknowledged them, the records are done → commit the partition's
watermark. Duplicates (extractor retries, replays) are dropped; corrupt or
incomplete samples go to the DLQ and never reach the dataset.
"""

from __future__ import annotations

import ctypes
import logging
import signal
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from confluent_kafka import Consumer, KafkaError, Message, TopicPartition

from runtime.kafka import DeliveryFailed, consumer_config, ensure_topics, make_producer
from runtime.kafka.config import MAX_MESSAGE_BYTES
from runtime.health import HealthServer
from runtime.logs import record_fields, redact
from runtime.kafka.commits import as_offsets, commit_watermarks, partition_lag
from runtime.settings import KafkaSettings, TopicSettings
from runtime.watermarks import Watermarks
from schemas import DlqHeaders, HiddenStatesReady
from sink import metrics
from sink.assembler import Assembler, Record, Rejected, Sample
from sink.shards import OpenShard, partition_prefix, read_indexes, remove_orphans, stored_token_ids, write_shard
from sink.storage import LocalStorage, Storage

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SinkOptions:
    output: Path
    group_id: str = "hsx-sink"
    dataset: str | None = None
    """Name used in the deterministic ready-event ids (default: the output folder's name)."""
    max_shard_bytes: int = 1 << 30
    max_shard_samples: int = 10_000
    max_shard_age: float = 60.0
    max_buffer_bytes: int = 2 << 30
    """Bytes held in memory (blocks awaiting manifests + open shards); partitions
    pause above it."""
    incomplete_timeout: float = 600.0
    session_timeout_ms: int = 10_000
    commit_interval: float = 1.0
    exit_when_idle: float | None = None
    exactly_once: bool = False
    """Publish ready events and commit offsets in one Kafka transaction."""
    health_port: int | None = None
    """Serve /healthz, /readyz and /metrics here (0: any free port; None: off)."""


@dataclass
class SinkStats:
    samples: int = 0
    tokens: int = 0
    raw_bytes: int = 0
    shards: int = 0
    ready_events: int = 0
    duplicates: int = 0
    rejected: int = 0

    def as_dict(self) -> dict[str, int]:
        return {k: v for k, v in vars(self).items()}

    def describe(self) -> str:
        return (f"{self.samples} samples ({self.tokens} tokens, {self.raw_bytes} bytes) in {self.shards} shards, "
                f"{self.ready_events} ready events, {self.duplicates} duplicates dropped, {self.rejected} rejected")


@dataclass
class _Partition:
    topic: str
    partition: int
    assembler: Assembler
    shard: OpenShard
    seen: dict[str, HiddenStatesReady]
    """Samples already in the dataset (from its index): later copies are duplicates."""
    republish: list[tuple[HiddenStatesReady, list[int]]] = field(default_factory=list)
    """Ready events of duplicates, published again (consumers de-duplicate by event
    id): a crash between writing a shard and publishing its events must not leave
    trainers without them."""
    retry_at: float = 0.0
    backoff: float = 0.5


class Sink:
    """One sink process."""

    def __init__(self, kafka: KafkaSettings, topics: TopicSettings, options: SinkOptions,
                 storage: Storage | None = None) -> None:
        self.kafka = kafka
        self.topic_settings = topics
        self.topics = topics.topics()
        self.options = options
        self.storage = storage or LocalStorage(options.output)
        self.dataset = options.dataset or options.output.resolve().name
        self.stats = SinkStats()
        self._marks = Watermarks()
        self._partitions: dict[tuple[str, int], _Partition] = {}
        self._stopping = False
        self._paused = False
        self._last_activity = time.monotonic()
        self.health: HealthServer | None = None

    # -- lifecycle ---------------------------------------------------------------------

    def run(self) -> SinkStats:
        _release_large_buffers_to_the_os()
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: self.stop())
        ensure_topics(self.kafka, self.topic_settings, [self.topics.blocks, self.topics.blocks_dlq, self.topics.ready])
        if self.options.health_port is not None:
            self.health = HealthServer(self.options.health_port, self._readiness).start()
        self._producer = make_producer(self.kafka)
        self._ready = self._producer
        if self.options.exactly_once:
            self._ready = make_producer(self.kafka, **{
                "transactional.id": f"{self.options.group_id}-{uuid.uuid4().hex}",
                # librdkafka requires it to cover the producer's delivery timeout.
                "transaction.timeout.ms": 300_000,
            })
            self._ready.init_transactions(30)
        # librdkafka prefetches up to 64 MiB (plus one fetch response) by default,
        # outside the budget the sink pauses on: hold both to a quarter of that
        # budget each (at least one record).
        prefetch = max(MAX_MESSAGE_BYTES, self.options.max_buffer_bytes // 4)
        self._consumer = Consumer(consumer_config(self.kafka, self.options.group_id, **{
            "session.timeout.ms": self.options.session_timeout_ms,
            "queued.max.messages.kbytes": prefetch // 1024,
            "fetch.max.bytes": prefetch,
        }))
        self._consumer.subscribe([self.topics.blocks], on_assign=self._on_assign, on_revoke=self._on_revoke,
                                 on_lost=self._on_lost)
        try:
            self._loop()
            self._flush_all()
            self._republish_duplicates()
            self._commit()
        finally:
            self._consumer.close()
            self._producer.flush(30)
            if self.health is not None:
                self.health.stop()
        log.info("sink finished: %s", self.stats.describe())
        return self.stats

    def _readiness(self) -> tuple[bool, str]:
        if self._stopping:
            return False, "draining"
        if not self._partitions:
            return False, "no partitions assigned"
        return True, f"ready: {len(self._partitions)} partitions"

    def stop(self) -> None:
        log.info("stopping: flushing open shards")
        self._stopping = True

    def _loop(self) -> None:
        last_commit = self._last_activity = time.monotonic()
        while not self._stopping:
            self._producer.poll(0)
            for message in self._consumer.consume(num_messages=500, timeout=0.2):
                self._accept(message)
            self._housekeeping()
            if time.monotonic() - last_commit >= self.options.commit_interval:
                self._commit()
                for (topic, partition), lag in partition_lag(self._consumer).items():
                    metrics.LAG.labels(topic, str(partition)).set(lag)
                metrics.BUFFERED_BYTES.set(self._buffered())
                last_commit = time.monotonic()
            idle = self.options.exit_when_idle
            if idle is not None and time.monotonic() - self._last_activity >= idle:
                log.info("idle for %.0fs: stopping", idle)
                self._stopping = True

    # -- consumer-group callbacks ---------------------------------------------------------

    def _on_assign(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        metrics.REBALANCES.labels("assign").inc()
        self._last_activity = time.monotonic()
        for p in partitions:
            prefix = partition_prefix(p.topic, p.partition)
            for orphan in remove_orphans(self.storage, prefix):
                log.warning("removed %s: written before a crash, never indexed (its records will be replayed)", orphan)
            seen = {e.request_id: e for index in read_indexes(self.storage, prefix) for e in index.events}
            self._partitions[(p.topic, p.partition)] = _Partition(
                p.topic, p.partition, Assembler(self.options.incomplete_timeout), OpenShard(p.topic, p.partition), seen)
        log.info("assigned %s", [(p.topic, p.partition) for p in partitions])
        if self._paused:
            consumer.pause(partitions)

    def _on_revoke(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        """Make what we hold durable and commit it before the partitions move on."""
        log.info("revoked %s", [(p.topic, p.partition) for p in partitions])
        metrics.REBALANCES.labels("revoke").inc()
        keys = {(p.topic, p.partition) for p in partitions}
        for key in keys:
            if key in self._partitions:
                self._close_shard(self._partitions[key])
        self._republish_duplicates()
        self._commit(only=keys)
        for key in keys:
            self._partitions.pop(key, None)
            self._marks.forget(key)

    def _on_lost(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        for p in partitions:
            self._partitions.pop((p.topic, p.partition), None)
            self._marks.forget((p.topic, p.partition))

    # -- per record --------------------------------------------------------------------------

    def _accept(self, message: Message) -> None:
        error = message.error()
        if error is not None:
            if error.code() != KafkaError._PARTITION_EOF:
                log.warning("consumer error: %s", error)
            return
        self._last_activity = time.monotonic()
        key = (message.topic(), message.partition())
        state = self._partitions.get(key)
        if state is None:
            return  # revoked between fetch and delivery
        self._marks.track(key, message.offset())
        result = state.assembler.add(Record(message.offset(), message.key(), message.value() or b"", message.headers()))
        if isinstance(result, Rejected):
            self._reject(state, result)
        elif isinstance(result, Sample):
            self._add_sample(state, result)

    def _add_sample(self, state: _Partition, sample: Sample) -> None:
        request_id = sample.manifest.request_id
        for stale in state.assembler.supersede(request_id):
            self._reject(state, stale)
        first_tokens = self._stored_token_ids(state, request_id)
        if first_tokens is None:
            self._append(state, sample)
        elif first_tokens == sample.manifest.token_ids:
            self._drop_duplicate(state, sample)
        else:  # the same id for another prompt: keeping either silently would be wrong
            self._reject(state, Rejected(
                "conflicting_duplicate", f"request id {request_id} is already in the dataset with other token ids",
                sample.offsets, request_id, sample.manifest.model_dump_json().encode()))

    def _append(self, state: _Partition, sample: Sample) -> None:
        if not state.shard.accepts(sample):
            self._close_shard(state)
        state.shard.add(sample)
        shard = state.shard
        full = shard.nbytes >= self.options.max_shard_bytes or len(shard.samples) >= self.options.max_shard_samples
        if full and time.monotonic() >= state.retry_at:  # after a storage error, wait out the backoff
            self._close_shard(state)

    def _drop_duplicate(self, state: _Partition, sample: Sample) -> None:
        request_id = sample.manifest.request_id
        self.stats.duplicates += 1
        metrics.DUPLICATES.inc()
        log.info("duplicate of %s dropped (attempt %s)", request_id, sample.manifest.attempt_id,
                 extra=record_fields(request_id, state.topic, state.partition, sample.manifest_offset))
        if request_id in state.seen:
            state.republish.append((state.seen[request_id], sample.offsets))
        else:  # its first copy is in the open shard; its event comes with the shard
            self._done(state, sample.offsets)

    def _stored_token_ids(self, state: _Partition, request_id: str) -> list[int] | None:
        """The token ids of the copy of ``request_id`` the dataset already holds (in
        a shard, or in the open one), or None for a new request."""
        if request_id in state.seen:
            return stored_token_ids(self.storage, state.seen[request_id])
        return next((s.manifest.token_ids for s in state.shard.samples if s.manifest.request_id == request_id), None)

    def _reject(self, state: _Partition, rejected: Rejected) -> None:
        self.stats.rejected += 1
        metrics.REJECTED.labels(rejected.error_class).inc()
        log.warning("rejected %s at %s/%d: %s: %s", rejected.request_id, state.topic, state.partition,
                    rejected.error_class, rejected.reason,
                    extra=record_fields(rejected.request_id, state.topic, state.partition, rejected.offsets[-1]))
        headers = DlqHeaders.build(rejected.error_class, redact(rejected.reason), service="sink", source_topic=state.topic,
                                   source_partition=state.partition, source_offset=rejected.offsets[-1])
        key = (state.topic, state.partition)
        offsets = list(rejected.offsets)

        def delivered(err: KafkaError | None, _msg: Message) -> None:
            if err is None:
                for offset in offsets:
                    self._marks.done(key, offset)
            else:
                log.error("dead letter for %s not delivered: %s (its records stay uncommitted)", rejected.request_id, err)

        self._producer.produce(self.topics.blocks_dlq, value=rejected.value,
                               key=rejected.request_id.encode() if rejected.request_id else None,
                               headers=headers.to_kafka(), on_delivery=delivered)

    def _done(self, state: _Partition, offsets: list[int]) -> None:
        for offset in offsets:
            self._marks.done((state.topic, state.partition), offset)

    # -- shards -------------------------------------------------------------------------------

    def _close_shard(self, state: _Partition) -> bool:
        """Write the open shard, its index and its ready events. On a storage error
        keep everything (nothing is committed) and retry later with backoff."""
        shard = state.shard
        if not shard.samples:
            return True
        try:
            events = write_shard(self.storage, self.dataset, shard)
        except OSError as exc:
            state.retry_at = time.monotonic() + state.backoff
            log.error("cannot write shard %s (retrying in %.1fs): %s", shard.stem, state.backoff, exc)
            state.backoff = min(state.backoff * 2, 30.0)
            return False
        state.backoff = 0.5
        self._publish(state, events, [o for sample in shard.samples for o in sample.offsets])
        self.stats.shards += 1
        metrics.SHARDS.inc()
        for sample in shard.samples:
            self.stats.samples += 1
            self.stats.tokens += sample.manifest.num_tokens
            metrics.SAMPLES.inc()
            metrics.TOKENS.inc(sample.manifest.num_tokens)
            self.stats.raw_bytes += len(sample.hidden_states)
        state.seen.update((e.request_id, e) for e in events)
        state.shard = OpenShard(state.topic, state.partition)
        log.info("wrote %s (%d samples)", shard.stem, len(events))
        return True

    def _publish(self, state: _Partition, events: list[HiddenStatesReady], offsets: list[int]) -> None:
        """Publish ready events; the records behind them are done once Kafka has
        them. With ``exactly_once`` the events and the offsets they make
        committable go in one transaction."""
        if self.options.exactly_once:
            self._ready.begin_transaction()
        for event in events:
            self._ready.produce(self.topics.ready, value=event.model_dump_json().encode(), key=event.request_id.encode())
        if self.options.exactly_once:
            self._done(state, offsets)
            self._commit_transaction()
        else:
            if self._ready.flush(60) > 0:
                raise DeliveryFailed("ready events not acknowledged within 60s")
            self._done(state, offsets)
        self.stats.ready_events += len(events)
        metrics.READY_EVENTS.inc(len(events))

    def _republish_duplicates(self) -> None:
        for state in self._partitions.values():
            if state.republish:
                pending, state.republish = state.republish, []
                self._publish(state, [e for e, _ in pending], [o for _, offsets in pending for o in offsets])

    def _flush_all(self) -> None:
        for state in self._partitions.values():
            self._close_shard(state)

    def _housekeeping(self) -> None:
        now = time.monotonic()
        self._republish_duplicates()
        for state in self._partitions.values():
            for rejected in state.assembler.expire(now):
                self._reject(state, rejected)
            shard = state.shard
            aged = shard.samples and now - shard.opened_at >= self.options.max_shard_age
            if aged and now >= state.retry_at:
                self._close_shard(state)
        if self._buffered() > self.options.max_buffer_bytes:
            for state in self._partitions.values():
                if now >= state.retry_at:
                    self._close_shard(state)
        over = self._buffered() > self.options.max_buffer_bytes
        if over != self._paused:
            (self._consumer.pause if over else self._consumer.resume)(self._consumer.assignment())
            self._paused = over
            log.warning("memory budget %s: partitions %s", "exceeded" if over else "ok", "paused" if over else "resumed")

    def _buffered(self) -> int:
        return sum(s.assembler.pending_bytes + s.shard.nbytes for s in self._partitions.values())

    def _commit(self, only: set[tuple[str, int]] | None = None) -> None:
        if self.options.exactly_once:
            if self._marks.to_commit():
                self._ready.begin_transaction()
                self._commit_transaction()
            return
        with metrics.COMMIT_SECONDS.time():
            commit_watermarks(self._consumer, self._marks, only)

    def _commit_transaction(self) -> None:
        """Commit the open transaction together with every committable offset."""
        positions = self._marks.to_commit()
        if positions:
            self._ready.send_offsets_to_transaction(as_offsets(positions), self._consumer.consumer_group_metadata())
        self._ready.commit_transaction(60)
        self._marks.committed(positions)


def _release_large_buffers_to_the_os() -> None:
    """The sink churns through ~1 MiB record buffers. glibc raises its mmap
    threshold after freeing such a buffer, so later ones come from the heap, which
    fragments and keeps its high-water mark as RSS; a fixed threshold maps each
    large buffer on its own and unmaps it when freed. (Measured on 229 MiB of
    blocks: RSS growth 130 -> 76 MiB.)"""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return  # not glibc: nothing to tune
    m_mmap_threshold = -3  # from malloc.h
    libc.mallopt(m_mmap_threshold, 128 * 1024)
