"""The sink service: a consumer-group member on ``hidden_states.blocks``.

Data flows one way: consume → reassemble and verify samples (per partition) →
append to the partition's open shard → when the shard closes, the writer thread
writes it durably, then its index, while the loop consumes on → publish one
``hidden_states.ready`` event per sample → once Kafka acknowledged them, the
records are done → commit the partition's watermark. By-reference manifests
have their blocks read from the payload store first (:mod:`hsx.sink.payloads`).
Duplicates (extractor retries, replays) are dropped; corrupt or incomplete
samples go to the DLQ and never reach the dataset.
"""

from __future__ import annotations

import gc
import logging
import time

from confluent_kafka import Message

from hsx.dataset.encoding import encode
from hsx.dataset.sample import Sample
from hsx.dataset.shards import SHARDS, Spooling
from hsx.dataset.storage import Storage, StorageRefused, dataset_name, open_payload_store, open_storage
from hsx.runtime.errors import InvalidInput
from hsx.runtime.kafka import RecordProducer, ensure_topics
from hsx.runtime.kafka.config import MAX_MESSAGE_BYTES
from hsx.runtime.kafka.dead_letters import DeadLetters
from hsx.runtime.kafka.member import GroupMember
from hsx.runtime.kafka.watermarks import TopicPartitionKey
from hsx.runtime.logs import record_fields
from hsx.runtime.memory import keep_freed_memory
from hsx.runtime.settings import KafkaSettings, TopicSettings
from hsx.schemas import ErrorClass, HiddenStatesReady, Manifest
from hsx.sink.budget import MemoryBudget
from hsx.sink.assembler import Record, RejectedRecords, Staged
from hsx.sink.options import SinkOptions
from hsx.sink.partition import PartitionState
from hsx.sink.partition_count import check_topic, refusal
from hsx.sink.payloads import PayloadReader, StagedObjects
from hsx.sink.ready import ReadyPublisher
from hsx.sink.shard_writer import ShardWriter
from hsx.sink.stats import SinkStats

log = logging.getLogger(__name__)

POLL_S = 0.2
"""The longest the loop waits for records before its housekeeping."""
BUSY_POLL_S = 0.02
"""The longest while a shard is being written or ready events await Kafka's
acknowledgement: a shard that landed is announced, and its records are done,
within this, not up to a whole :data:`POLL_S` later."""


class Sink:
    """One sink process."""

    def __init__(self, kafka: KafkaSettings, topics: TopicSettings, options: SinkOptions,
                 storage: Storage | None = None, payloads: Storage | None = None) -> None:
        # What the budget holds is reused, never mapped afresh; before the clients below start their threads.
        keep_freed_memory(options.max_buffer_bytes)
        self.kafka = kafka
        self.topic_settings = topics
        self.topics = topics.topics()
        self.options = options
        self.storage = storage or open_storage(options.output, create=True, part_bytes=options.upload_part_bytes)
        self.dataset = options.dataset or dataset_name(options.output)
        self.stats = SinkStats()
        # librdkafka prefetches up to 64 MiB (plus one fetch response) by default,
        # outside the budget the sink pauses on: hold both to a quarter of that
        # budget each (at least one record).
        prefetch = max(MAX_MESSAGE_BYTES, options.max_buffer_bytes // 4)
        self.member = GroupMember(
            kafka, options.group_id, self.topics.blocks, "sink", self,
            consumer_overrides={"session.timeout.ms": options.session_timeout_ms,
                                "queued.max.messages.kbytes": prefetch // 1024, "fetch.max.bytes": prefetch},
            commit_interval=options.commit_interval, exit_when_idle=options.exit_when_idle,
            stall_timeout=options.stall_timeout,
        )
        if payloads is None and options.payload_store:
            payloads = open_payload_store(options.payload_store)
        self._payloads = PayloadReader(payloads, self.member.fail)
        self._staged = StagedObjects(payloads, options.staged_max_age)
        self._partitions: dict[TopicPartitionKey, PartitionState] = {}
        self._budget = MemoryBudget(options.max_buffer_bytes, self._partitions, self.member)
        self._recorded_partitions = 0
        shards_folder = self.storage.local_path(SHARDS)
        self._spooling = None if shards_folder is None else Spooling(
            shards_folder, options.spool_after_bytes, options.max_shard_bytes)

    def run(self) -> SinkStats:
        """Run until stopped (SIGTERM/SIGINT, idle timeout); flush, commit, leave.
        Raises :class:`~hsx.sink.partition_count.PartitionCountChanged` before joining the group when the
        blocks topic's partition count is not the dataset's, :class:`ServiceFailed`
        when it had to stop early."""
        # What is alive now (torch, pydantic, the clients) lives as long as the
        # process: out of the collector's way, whose full passes over it were a
        # tenth of the sink's CPU at hidden-state rates (perf, bench.datapath).
        gc.freeze()
        self.member.handle_signals(self.stop)
        ensure_topics(self.kafka, self.topic_settings, [self.topics.blocks, self.topics.blocks_dlq, self.topics.ready])
        producer = RecordProducer.connect(self.kafka, "sink", on_refused=self.member.fail)
        # Before joining the group: a blocks topic whose partition count is not the dataset's is refused.
        self._recorded_partitions = check_topic(producer.client, self.storage, self.topics.blocks, self.options.output)
        self.member.serve_health(self.options.health_port, lambda: None, lambda: f"{len(self._partitions)} partitions")
        self._dead_letters = DeadLetters(producer, "sink")
        ready = ReadyPublisher(self.kafka, producer, self.topics.ready, self.member.marks,
                               self.options.group_id if self.options.exactly_once else None)
        self._shards = ShardWriter(self.storage, self.dataset, ready, self.stats, self.member.fail, self._done,
                                   lambda state, shard: self._staged.add(state.key, (s.manifest for s in shard.samples)))
        self.member.subscribe(commit=lambda only: self._commit(ready, only))
        ready.bind(self.member.consumer)
        try:
            self._loop()
            if self.member.fatal is None:  # after a failure, a restart redoes the rest
                for state in self._partitions.values():
                    self._shards.settle(state)
                self._shards.republish(self._partitions.values())
            self.member.commit()
        finally:
            self._shards.shutdown()
            for state in self._partitions.values():
                state.drop()
            self.member.close()
            producer.client.flush(30)
        self.member.raise_if_failed()
        log.info("sink finished: %s", self.stats.describe())
        return self.stats

    def _commit(self, ready: ReadyPublisher, only: set[TopicPartitionKey] | None) -> None:
        """Every commit: 1. delete the staged objects no manifest needs any more
        (so none is committed while its object waits), 2. commit."""
        self._staged.delete()
        ready.commit(only)

    def stop(self) -> None:
        log.info("stopping: flushing open shards")
        self.member.stop()

    def _loop(self) -> None:
        while not self.member.stopping:
            self._dead_letters.producer.poll(0)
            for message in self.member.poll(500, timeout=self._poll_timeout()):
                self._accept(message)
                if self._budget.over():
                    break  # the rest waits in the client's queue; housekeeping pauses
            self._housekeeping()
            self.stats.buffered(self._budget.buffered(), sum(s.unwritten_samples for s in self._partitions.values()))
            self.member.tick()

    def _poll_timeout(self) -> float:
        """How long the next poll may wait for records: :data:`BUSY_POLL_S` while a
        shard is being written or ready events are unacknowledged, else
        :data:`POLL_S`, and never past the moment the first open shard is due."""
        states = self._partitions.values()
        if self._dead_letters.producer.pending or any(state.writing is not None for state in states):
            return BUSY_POLL_S
        now = time.monotonic()
        due = [state.shard.due_in(now, self.options.max_shard_age, self.options.flush_when_idle)
               for state in states if state.shard.samples]
        return max(0.0, min([POLL_S, *due]))

    # -- partitions come and go (PartitionHandler) ---------------------------------------------

    def assigned(self, partitions: list[TopicPartitionKey]) -> None:
        grown = [p for _, p in partitions if p >= self._recorded_partitions]
        if grown:  # partitions added while we run: stop (a restart refuses before joining)
            self.member.fail(refusal(self.options.output, self.topics.blocks, self._recorded_partitions,
                                     f"at least {max(grown) + 1}"))
            return
        started = time.monotonic()
        for topic, partition in partitions:
            try:
                state = PartitionState.load(self.storage, topic, partition, self.options.incomplete_timeout,
                                            self.options.dataset_codec, self.options.max_sample_bytes, self._spooling)
            except (StorageRefused, OSError) as exc:  # refused, or unavailable past the client's retries:
                self.member.fail(exc)                  # stop; nothing of the partition was processed or committed
                return
            self._partitions[(topic, partition)] = state
            log.info("%s-%d: %d samples already stored (%d KiB of dedupe keys)", topic, partition, len(state.keys),
                     state.keys.nbytes // 1024)
        self.stats.partitions_loaded(time.monotonic() - started, sum(len(s.keys) for s in self._partitions.values()))

    def revoked(self, partitions: list[TopicPartitionKey]) -> None:
        """Make what we hold durable before the member commits and the partitions move on."""
        states = [self._partitions.pop(key) for key in partitions if key in self._partitions]
        for state in states:
            self._shards.settle(state)
            state.drop()
        self._shards.republish(states)

    def lost(self, partitions: list[TopicPartitionKey]) -> None:
        """The next owner replays the rest; a write under way lands first, not beside its."""
        for key in partitions:
            if (state := self._partitions.pop(key, None)) is not None:
                self._shards.wait(state)
                state.drop()
            self._staged.forget(key)

    # -- per record ----------------------------------------------------------------------------

    def _accept(self, message: Message) -> None:
        state = self._partitions.get((message.topic(), message.partition()))
        if state is None:  # refused (see assigned): never processed, so never committed
            return
        result = state.assembler.add(Record(message.offset(), message.key(), message.value() or b"", message.headers()))
        if not isinstance(result, Staged):
            self._take(state, [result])
        elif not self._settled(state, result.manifest, [result.offset]):  # else never fetched
            self._take(state, self._payloads.accept(state, result))

    def _take(self, state: PartitionState, results: list[Sample | RejectedRecords | None]) -> None:
        for result in results:
            if isinstance(result, RejectedRecords):
                self._reject(state, result)
            elif isinstance(result, Sample) and not self._settled(state, result.manifest, result.offsets):
                self._append(state, result)

    def _settled(self, state: PartitionState, manifest: Manifest, offsets: list[int]) -> bool:
        """Settle a request the partition already holds, from its manifest alone:
        a duplicate is dropped (and its staged object is not needed), another
        prompt under the same id is a dead letter. False for a new request."""
        request_id = manifest.request_id
        for stale in state.assembler.supersede(request_id):
            self._reject(state, stale)
        stored = state.stored_copy(self.storage, request_id, manifest.token_ids)
        if stored is None:
            return False
        if stored.same_tokens:
            if stored.event is None:  # its first copy waits in a shard not yet written
                self._staged.add_with_copy(state.key, manifest)
            else:
                self._staged.add(state.key, [manifest])
            self._drop_duplicate(state, manifest, offsets, stored.event)
        else:  # the same id for another prompt: keeping either silently would be wrong
            self._reject(state, RejectedRecords(
                ErrorClass.CONFLICTING_DUPLICATE, f"request id {request_id} is already in the dataset with other token ids",
                offsets, request_id, manifest.model_dump_json().encode()))
        return True

    def _append(self, state: PartitionState, sample: Sample) -> None:
        sample = encode(sample, self.options.dataset_codec)  # on arrival: the open shard holds only what it stores
        if not state.shard.accepts(sample):
            self._shards.close(state)
        state.shard.add(sample)
        if (state.shard.nbytes >= self.options.max_shard_bytes
                or len(state.shard.samples) >= self.options.max_shard_samples):
            self._shards.close(state)

    def _drop_duplicate(self, state: PartitionState, manifest: Manifest, offsets: list[int],
                        event: HiddenStatesReady | None) -> None:
        self.stats.add("duplicates")
        log.info("duplicate of %s dropped (attempt %s)", manifest.request_id, manifest.attempt_id,
                 extra=record_fields(manifest.request_id, state.topic, state.partition, offsets[-1]))
        if event is not None:
            state.republish.append((event, offsets))
        else:  # its first copy waits in a shard not yet written; its event comes with the shard
            self._done(state, offsets)

    def _reject(self, state: PartitionState, rejected: RejectedRecords) -> None:
        """Dead-letter ``rejected``; its records are done once Kafka has the letter."""
        self.stats.add("rejected", label=rejected.error_class.value)
        key = rejected.request_id.encode() if rejected.request_id else None
        self._dead_letters.send(
            self.topics.blocks_dlq, InvalidInput(rejected.error_class, rejected.reason), rejected.value, key,
            lambda: self._done(state, rejected.offsets),
            source_topic=state.topic, source_partition=state.partition, source_offset=rejected.offsets[-1])

    def _done(self, state: PartitionState, offsets: list[int]) -> None:
        for offset in offsets:
            self.member.done(state.key, offset)

    # -- shards --------------------------------------------------------------------------------

    def _housekeeping(self) -> None:
        now = time.monotonic()
        self._shards.reap(self._partitions.values())
        self._shards.republish(self._partitions.values())
        self._staged.sweep(now)
        over = self._budget.over()
        for state in self._partitions.values():
            for rejected in state.assembler.expire(now):
                self._reject(state, rejected)
            self._take(state, self._payloads.retry(state, now))
            if state.shard.samples and (over or state.shard.due(now, self.options.max_shard_age,
                                                                  self.options.flush_when_idle)):
                self._shards.close(state)
        self._budget.settle(over)
