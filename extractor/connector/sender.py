"""Worker side of the connector, after the gather: compress a request's blocks
(:mod:`hsx.extractor.connector.records`) on a thread pool, produce the block
records in order and then the manifest, and declare the request finished only when
Kafka acknowledged every record. By reference (``payload_store``), one thread
encodes the blocks in order and writes them into one staged object instead
(streamed: a multipart upload on S3), and the manifest is produced once the
object is durable.

Threads:

* vLLM's worker thread submits transfers and takes the finished ones;
* inline, the compression pool encodes blocks and produces those next in order (a
  block encoded before ``submit`` attached its callback is produced from the
  worker thread, which is fine: producing never waits);
* by reference, a thread of the :class:`~hsx.extractor.connector.staging.Stager`'s
  pool encodes each block of a transfer and writes it, then produces the manifest;
* one poller thread serves delivery reports, which complete transfers, and
  retries stalled transfers.

Each transfer's state is guarded by its own lock, taken by all three; the
sender's lock (stalled transfers) and the in-flight budget's
(:mod:`~hsx.extractor.connector.budget`: bytes, finished requests) are only ever
taken inside a transfer's lock or alone, never the other way round. Nothing blocks or sleeps
while holding a lock: when librdkafka's local queue is full a transfer is left
*stalled* (its next record not queued) and the poller, which frees room by
serving delivery reports, produces it again after each poll. Nothing here
blocks vLLM's worker thread.

Failures: a transfer whose block cannot be encoded, or whose manifest fails its
own checks, is reported failed (the extractor retries it). A record Kafka
*refuses* (its delivery report carries an error) is fatal: the report says
``refused`` and the extractor stops instead of retrying.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor

from typing_extensions import Buffer

from hsx.codecs.framing import Record
from hsx.extractor.completion import CompletionSender
from hsx.extractor.connector.gather import Gathered
from hsx.extractor.connector.budget import Budget
from hsx.extractor.connector.metadata import SendJob
from hsx.extractor.connector.records import block_ranges, block_ref, encode_rows, manifest_record, raw_bytes
from hsx.extractor.connector.staging import Stager
from hsx.extractor.connector.transfer import Transfer
from hsx.runtime.kafka import DeliveryFailed, RecordProducer
from hsx.runtime.settings import KafkaSettings
from hsx.schemas import BlockRecordHeaders, RecordKind
from hsx.schemas.connector import ConnectorConfig, RequestParams
from hsx.schemas.reports import CompletionReport, KafkaState

log = logging.getLogger(__name__)

STATE_SECONDS = 1.0
"""How often a :class:`KafkaState` goes to whoever asked for it (``hsx serve``)."""


class BlockSender:
    """Sends gathered hidden states to ``hidden_states.blocks``; bounded by
    ``max_inflight_bytes`` of raw hidden states not yet acknowledged."""

    def __init__(
        self,
        config: ConnectorConfig,
        kafka: KafkaSettings,
        layer_ids: list[int],
        completions: CompletionSender,
        state: Callable[[KafkaState], None] | None = None,
    ) -> None:
        self._config = config
        self._state = state
        self._layer_ids = layer_ids
        self._completions = completions
        self._producer = RecordProducer.connect(
            kafka, "connector",
            # Room for every byte the budget allows in flight, so the local queue
            # is seldom full (then transfers stall until the poller frees room).
            **{"queue.buffering.max.kbytes": min(2**31 - 1, 2 * config.max_inflight_bytes // 1024)},
        )
        self._pool = ThreadPoolExecutor(config.compress_threads, thread_name_prefix="hsx-encode")
        self._stager = Stager(config.payload_store, config.upload_threads) if config.payload_store else None
        self._budget = Budget(config.max_inflight_bytes)
        self._lock = threading.Lock()
        self._stalled: dict[Transfer, None] = {}
        """Transfers whose next record found the queue full, oldest first."""
        self._closing = threading.Event()
        self._poller = threading.Thread(target=self._poll, name="hsx-kafka-poll", daemon=True)
        self._poller.start()

    # -- called from vLLM's worker thread -------------------------------------------

    def has_room(self, nbytes: int) -> bool:
        """Whether a request of ``nbytes`` raw bytes fits the in-flight budget (one
        request always fits when nothing else is in flight)."""
        return self._budget.has_room(nbytes)

    def submit(self, job: SendJob, gathered: Gathered) -> None:
        """Start sending one request's hidden states."""
        # Lax: the params crossed msgpack, where tuples become lists.
        params = RequestParams.model_validate(job.params, strict=False)
        ranges = block_ranges(gathered, self._config.target_block_bytes)
        transfer = Transfer(job, params, gathered, ranges, raw_bytes=raw_bytes(gathered))
        self._budget.admit(transfer.raw_bytes)
        if self._stager is not None:
            transfer.uploading = True
            self._stager.stage(params.request_id, params.attempt_id, self._staged_blocks(transfer),
                               lambda error, t=transfer: self._staged(t, error))
            return
        transfer.encoded = [None] * len(ranges)
        transfer.encoding = len(ranges)
        for index in range(len(ranges)):
            self._pool.submit(self._encode, transfer, index).add_done_callback(
                lambda f, t=transfer, i=index: self._encoded(t, i, f)
            )

    def fail(self, job: SendJob, reason: str) -> None:
        """Give up on a job before it was submitted (e.g. the gather failed): report
        the failure so the extractor retries, and let vLLM free the blocks."""
        log.error("cannot send %s: %s", job.engine_request_id, reason)
        try:
            params = RequestParams.model_validate(job.params, strict=False)
        except ValueError:
            params = None  # unreadable params: the extractor's timeout retries it
        if params is not None:
            self._completions.send(
                CompletionReport(request_id=params.request_id, attempt_id=params.attempt_id, ok=False, error=reason)
            )
        self._budget.never_admitted(job.engine_request_id)

    def take_finished(self) -> set[str]:
        """Engine request ids whose transfer ended (acknowledged or failed) since
        the last call; vLLM may free their blocks now."""
        return self._budget.take_finished()

    # -- compression pool (inline) and stager (by reference) ------------------------------

    def _encode(self, transfer: Transfer, index: int) -> Record:
        start, end = transfer.ranges[index]
        return encode_rows(transfer.gathered, start, end, transfer.job.first_row + start, self._config)

    def _staged_blocks(self, transfer: Transfer) -> Iterator[list[Buffer]]:
        """By reference: ``transfer``'s blocks, each encoded in order on the
        stager's thread that writes it, with what the manifest will say of it."""
        for index in range(len(transfer.ranges)):
            try:
                record = self._encode(transfer, index)
            except Exception as exc:
                with transfer.lock:
                    transfer.error = f"encoding block {index} failed: {exc!r}"
                raise
            with transfer.lock:
                transfer.block_sent(block_ref(index, record), record.nbytes)
            yield record.pieces

    def _encoded(self, transfer: Transfer, index: int, future: Future[Record]) -> None:
        with transfer.lock:
            transfer.encoding -= 1
            if future.exception() is not None:
                transfer.error = transfer.error or f"encoding block {index} failed: {future.exception()!r}"
            else:
                transfer.encoded[index] = future.result()
            self._produce_ready(transfer)

    def _staged(self, transfer: Transfer, error: BaseException | None) -> None:
        """By reference: the staged object is durable (or failed); the manifest may follow."""
        with transfer.lock:
            transfer.uploading = False
            if error is not None:
                transfer.error = transfer.error or f"staging its blocks failed: {error}"
            self._produce_ready(transfer)

    def _produce_ready(self, transfer: Transfer) -> None:
        """Produce every block that is encoded and next in order, then the manifest;
        complete the transfer if that was all. Called with ``transfer.lock`` held."""
        if transfer.error is None:
            try:
                self._produce_in_order(transfer)
            except Exception as exc:  # noqa: BLE001 - e.g. a manifest that fails its own checks
                transfer.error = f"{type(exc).__name__}: {exc}"
        self._maybe_complete(transfer)

    def _produce_in_order(self, transfer: Transfer) -> None:
        """Queue records until the next block is not encoded yet, the local queue
        is full (the transfer stalls), or the manifest is queued. By reference
        the blocks are staged (and counted) before this is called."""
        while transfer.next_to_produce < len(transfer.ranges):
            index = transfer.next_to_produce
            record = transfer.encoded[index]
            if record is None:
                return
            headers = BlockRecordHeaders(kind=RecordKind.BLOCK, attempt_id=transfer.params.attempt_id,
                                         block_index=index, codec=self._config.codec)
            if not self._produce(transfer, record.value(), headers):
                return
            transfer.block_sent(block_ref(index, record), record.nbytes)
            transfer.encoded[index] = None  # now the producer's queue's
        if transfer.uploading:
            return  # the manifest waits until the staged object is durable
        if not transfer.manifest_sent:
            if transfer.manifest is None:
                assert len(transfer.refs) == len(transfer.ranges)  # every block was sent before the manifest
                transfer.manifest = manifest_record(transfer.job, transfer.params, transfer.gathered, transfer.refs,
                                                    self._config, self._layer_ids)
            headers = BlockRecordHeaders(kind=RecordKind.MANIFEST, attempt_id=transfer.params.attempt_id)
            if not self._produce(transfer, transfer.manifest, headers):
                return
            transfer.manifest_sent = True
            transfer.manifest = None  # the bytes now live in the producer's queue

    def _produce(self, transfer: Transfer, value: bytes, headers: BlockRecordHeaders) -> bool:
        """Queue one record of ``transfer``; ``False`` (nothing queued, the
        transfer stalled) when librdkafka's local queue is full. Called with
        ``transfer.lock`` held, which the delivery reports need: never waits."""
        key, kafka_headers = transfer.params.request_id.encode(), headers.to_kafka()
        queued = self._producer.produce(
            self._config.blocks_topic, value, key, kafka_headers,
            on_acked=lambda t=transfer: self._acked(t),
            wait_for_room=False,
            on_refused_record=lambda refusal, t=transfer: self._refused(t, refusal),
        )
        if queued:
            transfer.unacked += 1
            transfer.kafka_bytes += len(key) + len(value) + sum(len(k) + len(v) for k, v in kafka_headers)
        else:
            with self._lock:
                self._stalled[transfer] = None
        return queued

    # -- Kafka poller thread ------------------------------------------------------------

    def _poll(self) -> None:
        told = time.monotonic()
        while not self._closing.is_set():
            self._producer.poll(0.1)
            self._retry_stalled()
            if self._state is not None and time.monotonic() - told >= STATE_SECONDS:
                told = time.monotonic()
                self._state(self._budget.state(told))

    def _retry_stalled(self) -> None:
        """Produce again for the transfers that found the queue full (the poll just
        served delivery reports, which made room); those still finding it full
        stall again."""
        with self._lock:
            stalled, self._stalled = self._stalled, {}
        for transfer in stalled:
            with transfer.lock:
                self._produce_ready(transfer)

    def _acked(self, transfer: Transfer) -> None:
        self._budget.acked()
        with transfer.lock:
            transfer.unacked -= 1
            self._maybe_complete(transfer)

    def _refused(self, transfer: Transfer, refusal: DeliveryFailed) -> None:
        with transfer.lock:
            transfer.unacked -= 1
            if not transfer.refused:
                transfer.refused = True
                # No further record of this attempt is produced: its manifest never goes out.
                transfer.error = f"{transfer.error}; then {refusal}" if transfer.error else str(refusal)
            self._maybe_complete(transfer)

    def _maybe_complete(self, transfer: Transfer) -> None:
        """Called with ``transfer.lock`` held: finish once nothing is outstanding."""
        settled = transfer.manifest_sent or transfer.error is not None
        if transfer.completed or not settled or transfer.unacked or transfer.encoding or transfer.uploading:
            return
        transfer.completed = True
        report = transfer.report()
        if transfer.error:
            log.error("transfer of %s failed: %s", transfer.params.request_id, transfer.error)
        if transfer.gathered.release is not None:
            transfer.gathered.release()
        self._completions.send(report)
        with self._lock:
            self._stalled.pop(transfer, None)
        self._budget.settle(transfer.job.engine_request_id, transfer.raw_bytes)

    def close(self, timeout: float = 30.0) -> None:
        """Wait up to ``timeout`` for the transfers in flight to end, then stop threads."""
        self._pool.shutdown(wait=True)
        if self._stager is not None:
            self._stager.close()
        if unfinished := self._budget.wait_idle(timeout):
            log.warning("closing with %d transfer(s) unfinished after %.0fs: their attempts are not reported",
                        unfinished, timeout)
        self._closing.set()
        self._poller.join(timeout=5)
        self._completions.close()
