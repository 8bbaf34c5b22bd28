"""Worker side of the connector, after the gather: cut a request's hidden states
into blocks of whole tokens, compress them on a thread pool, produce block records
in order and then the manifest, and declare the request finished only when Kafka
acknowledged every record.

Threads: vLLM's worker thread submits; the compression pool encodes and produces
(``Producer.produce`` is thread-safe); one poller thread serves delivery callbacks,
which complete transfers. Nothing here blocks vLLM's worker thread.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch
from confluent_kafka import KafkaError, Message

from extractor.completion import CompletionSender
from extractor.connector.gather import Gathered
from extractor.connector.metadata import SendJob, answer_fields
from runtime.kafka import make_producer
from runtime.settings import KafkaSettings
from runtime.tensors import WIRE_DTYPES
from schemas import BlockRecordHeaders, BlockRef, Manifest, RecordKind
from schemas.codec import encode_block, read_header
from schemas.fp8_blocks import encode_fp8_block
from schemas.connector import CompletionReport, ConnectorConfig, RequestParams

log = logging.getLogger(__name__)


@dataclass
class _Transfer:
    """State of one request attempt in flight."""

    job: SendJob
    params: RequestParams
    gathered: Gathered
    ranges: list[tuple[int, int]]
    raw_bytes: int
    encoded: list[bytes | None] = field(default_factory=list)
    encoding: int = 0
    """Blocks still on the compression pool."""
    next_to_produce: int = 0
    unacked: int = 0
    manifest_sent: bool = False
    completed: bool = False
    compressed_bytes: int = 0
    error: str | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)


class BlockSender:
    """Sends gathered hidden states to ``hidden_states.blocks``; bounded by
    ``max_inflight_bytes`` of raw hidden states not yet acknowledged."""

    def __init__(
        self,
        config: ConnectorConfig,
        kafka: KafkaSettings,
        layer_ids: list[int],
        completions: CompletionSender,
    ) -> None:
        self._config = config
        self._layer_ids = layer_ids
        self._completions = completions
        self._producer = make_producer(
            kafka,
            # Room for every byte we allow in flight, so produce() never finds the
            # local queue full under the budget.
            **{"queue.buffering.max.kbytes": min(2**31 - 1, 2 * config.max_inflight_bytes // 1024)},
        )
        self._pool = ThreadPoolExecutor(config.compress_threads, thread_name_prefix="hsx-encode")
        self._lock = threading.Lock()
        self._finished: set[str] = set()
        self._inflight_bytes = 0
        self._inflight = 0
        self._closing = threading.Event()
        self._poller = threading.Thread(target=self._poll, name="hsx-kafka-poll", daemon=True)
        self._poller.start()

    # -- called from vLLM's worker thread -------------------------------------------

    def has_room(self, nbytes: int) -> bool:
        """Whether a request of ``nbytes`` raw bytes fits the in-flight budget (one
        request always fits when nothing else is in flight)."""
        with self._lock:
            return self._inflight == 0 or self._inflight_bytes + nbytes <= self._config.max_inflight_bytes

    def submit(self, job: SendJob, gathered: Gathered) -> None:
        """Start sending one request's hidden states."""
        # Lax: the params crossed msgpack, where tuples become lists.
        params = RequestParams.model_validate(job.params, strict=False)
        tokens, layers, hidden = gathered.tensor.shape
        # Blocks are cut by the bytes they carry (fp8: a code per element and a
        # float32 scale per layer); raw_bytes, the budget's and the statistics'
        # measure, counts the hidden states in the model's dtype either way.
        sent_row_bytes = layers * hidden * gathered.tensor.element_size() + (
            0 if gathered.scales is None else layers * gathered.scales.element_size())
        per_block = max(1, self._config.block_bytes // sent_row_bytes)
        ranges = [(start, min(start + per_block, tokens)) for start in range(0, tokens, per_block)]
        raw_bytes = tokens * layers * hidden * gathered.source_dtype.itemsize
        transfer = _Transfer(job, params, gathered, ranges, raw_bytes=raw_bytes)
        transfer.encoded = [None] * len(ranges)
        transfer.encoding = len(ranges)
        with self._lock:
            self._inflight += 1
            self._inflight_bytes += transfer.raw_bytes
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
        with self._lock:
            self._finished.add(job.engine_request_id)

    def take_finished(self) -> set[str]:
        """Engine request ids whose transfer ended (acknowledged or failed) since
        the last call; vLLM may free their blocks now."""
        with self._lock:
            finished, self._finished = self._finished, set()
        return finished

    # -- compression pool -------------------------------------------------------------

    def _encode(self, transfer: _Transfer, index: int) -> bytes:
        start, end = transfer.ranges[index]
        gathered = transfer.gathered
        rows = gathered.wait()[start:end]
        shape: tuple[int, int, int] = tuple(rows.shape)  # type: ignore[assignment]
        dtype, token_start = WIRE_DTYPES[gathered.source_dtype], transfer.job.first_row + start
        if gathered.scales is None:
            return encode_block(rows.view(torch.uint8).numpy(), shape=shape, dtype=dtype, token_start=token_start,
                                codec=self._config.codec, level=self._config.codec_level)
        scales = gathered.scales[start:end]
        if not bool(torch.isfinite(scales).all()):  # a row's amax was inf or NaN
            raise ValueError("fp8 cannot hold non-finite hidden states (E4M3FN has no infinities); "
                             "extract this model with --wire-dtype model")
        return encode_fp8_block(rows.numpy(), scales.numpy(), shape=shape, dtype=dtype, token_start=token_start,
                                codec=self._config.codec, level=self._config.codec_level)

    def _encoded(self, transfer: _Transfer, index: int, future: Future[bytes]) -> None:
        with transfer.lock:
            transfer.encoding -= 1
            if future.exception() is not None:
                transfer.error = transfer.error or f"encoding block {index} failed: {future.exception()!r}"
            else:
                transfer.encoded[index] = future.result()
            self._produce_ready(transfer)

    def _produce_ready(self, transfer: _Transfer) -> None:
        """Produce every block that is encoded and next in order, then the manifest.
        Called with ``transfer.lock`` held."""
        if transfer.error is None:
            try:
                while transfer.next_to_produce < len(transfer.ranges):
                    value = transfer.encoded[transfer.next_to_produce]
                    if value is None:
                        return
                    self._produce_block(transfer, transfer.next_to_produce, value)
                    transfer.next_to_produce += 1
                if not transfer.manifest_sent:
                    self._produce_manifest(transfer)
            except Exception as exc:  # noqa: BLE001 - e.g. a manifest that fails its own checks
                transfer.error = f"{type(exc).__name__}: {exc}"
        self._maybe_complete(transfer)

    def _produce_block(self, transfer: _Transfer, index: int, value: bytes) -> None:
        headers = BlockRecordHeaders(
            kind=RecordKind.BLOCK, attempt_id=transfer.params.attempt_id, block_index=index, codec=self._config.codec
        )
        self._produce(transfer, value, headers)
        transfer.compressed_bytes += len(value)

    def _produce_manifest(self, transfer: _Transfer) -> None:
        params = transfer.params
        tensor = transfer.gathered.tensor
        blocks = []
        for index, value in enumerate(transfer.encoded):
            assert value is not None
            header, _ = read_header(value)
            blocks.append(
                BlockRef(
                    index=index,
                    token_start=header.token_start,
                    token_end=header.token_end,
                    checksum=header.checksum,
                    compressed_nbytes=len(value),
                )
            )
        manifest = Manifest(
            request_id=params.request_id,
            attempt_id=params.attempt_id,
            model=self._config.model,
            layer_ids=self._layer_ids,
            dtype=WIRE_DTYPES[transfer.gathered.source_dtype],
            hidden_size=tensor.shape[2],
            num_tokens=len(transfer.job.token_ids),
            token_ids=transfer.job.token_ids,
            **answer_fields(transfer.job, params),
            codec=self._config.codec,
            quantization="fp8" if transfer.gathered.scales is not None else None,
            blocks=blocks,
            metadata=params.metadata,
            source=params.source,
        )
        # Unquantized manifests leave the field out, as before it existed (older sinks forbid unknown fields).
        value = manifest.model_dump_json(exclude=None if manifest.quantization else {"quantization"}).encode()
        self._produce(transfer, value, BlockRecordHeaders(
            kind=RecordKind.MANIFEST, attempt_id=params.attempt_id))
        transfer.manifest_sent = True
        transfer.encoded = []  # the bytes now live in the producer's queue

    def _produce(self, transfer: _Transfer, value: bytes, headers: BlockRecordHeaders) -> None:
        key = transfer.params.request_id.encode()
        while True:
            try:
                self._producer.produce(
                    self._config.blocks_topic,
                    value=value,
                    key=key,
                    headers=headers.to_kafka(),
                    on_delivery=lambda err, msg, t=transfer: self._delivered(t, err, msg),
                )
                transfer.unacked += 1
                return
            except BufferError:
                # Local queue full (only above the budget): the poller frees room.
                time.sleep(0.01)

    # -- Kafka poller thread ------------------------------------------------------------

    def _poll(self) -> None:
        while not self._closing.is_set():
            self._producer.poll(0.1)

    def _delivered(self, transfer: _Transfer, err: KafkaError | None, msg: Message) -> None:
        with transfer.lock:
            transfer.unacked -= 1
            if err is not None and transfer.error is None:
                transfer.error = f"Kafka rejected a record of {transfer.params.request_id}: {err.str()}"
            self._maybe_complete(transfer)

    def _maybe_complete(self, transfer: _Transfer) -> None:
        """Called with ``transfer.lock`` held: finish once nothing is outstanding."""
        settled = transfer.manifest_sent or transfer.error is not None
        if transfer.completed or not settled or transfer.unacked or transfer.encoding:
            return
        transfer.completed = True
        report = CompletionReport(
            request_id=transfer.params.request_id,
            attempt_id=transfer.params.attempt_id,
            ok=transfer.error is None,
            error=transfer.error,
            num_tokens=transfer.gathered.tensor.shape[0],
            raw_bytes=transfer.raw_bytes,
            compressed_bytes=transfer.compressed_bytes,
        )
        if transfer.error:
            log.error("transfer of %s failed: %s", transfer.params.request_id, transfer.error)
        if transfer.gathered.release is not None:
            transfer.gathered.release()
        self._completions.send(report)
        with self._lock:
            self._inflight -= 1
            self._inflight_bytes -= transfer.raw_bytes
            self._finished.add(transfer.job.engine_request_id)

    def close(self, timeout: float = 30.0) -> None:
        """Wait for outstanding records (up to ``timeout``), then stop threads."""
        self._pool.shutdown(wait=True)
        self._producer.flush(timeout)
        self._closing.set()
        self._poller.join(timeout=5)
        self._completions.close()
