"""Worker side of the connector, between vLLM's step and the outputs: each
finished request's :class:`SendJob` waits until every output it goes to (the
Kafka :class:`BlockSender`, the :class:`FileWriter`) has room for its rows, is
gathered from the hidden-state cache once per output, and handed on; vLLM may
free the request's blocks once every output has its rows.

Only tensor-parallel rank 0 has one (every rank holds the same hidden states).
Called from vLLM's worker thread alone.
"""

from __future__ import annotations

import logging
from collections import deque

import torch

from hsx.extractor.connector.files import FileWriter
from hsx.extractor.connector.gather import CudaGatherer, Gathered, gather_cpu
from hsx.extractor.connector.metadata import HsxConnectorMetadata, SendJob
from hsx.extractor.connector.sender import BlockSender

log = logging.getLogger(__name__)


class Captures:
    """The jobs of one worker, from the step's metadata to the outputs."""

    def __init__(self, cache: torch.Tensor, block_size: int, sender: BlockSender | None, writer: FileWriter | None,
                 fp8_to_kafka: bool) -> None:
        self._cache = cache
        self._cuda = CudaGatherer(cache) if cache.is_cuda else None
        self._block_size = block_size
        self._sender = sender
        self._writer = writer
        self._fp8_to_kafka = fp8_to_kafka
        _, layers, _, hidden = cache.shape
        self._row_bytes = layers * hidden * cache.element_size()
        self._waiting: deque[SendJob] = deque()
        self._outputs_left: dict[str, int] = {}
        """Per request being sent: how many of its outputs (Kafka, file) still need its blocks."""
        self._finished: set[str] = set()
        """Requests whose every output has its rows, not yet reported to vLLM."""

    def bind(self, metadata: HsxConnectorMetadata) -> None:
        """Before the step's forward pass: 1. take the locks of the files of newly
        scheduled requests (the step, and with it any response naming them, ends
        after that); 2. drop those of aborted ones; 3. start the captures of the
        requests that finished, so none waits out this step's forward pass."""
        if self._writer is not None:
            for path in metadata.holds:
                try:
                    self._writer.hold(path)
                except OSError as exc:  # a full or unwritable disk: that file is missing, the engine goes on
                    log.error("cannot create the lock of %s: %s", path, exc)
            for path in metadata.drops:
                self._writer.drop(path)
        self._waiting.extend(metadata.sends)
        self._start_waiting()

    def finished(self) -> set[str]:
        """Start those the budgets held back if there is room now; the requests
        whose blocks vLLM may free since the last call."""
        self._start_waiting()
        for request_id in (*(self._sender.take_finished() if self._sender else ()),
                           *(self._writer.take_copied() if self._writer else ())):
            self._output_done(request_id)
        finished, self._finished = self._finished, set()
        return finished

    def close(self) -> None:
        if self._sender is not None:
            self._sender.close()
        if self._writer is not None:
            self._writer.close()

    def _output_done(self, request_id: str) -> None:
        """One output of ``request_id`` no longer needs its blocks; with the last
        one, vLLM may free them (the next :meth:`finished` says so)."""
        self._outputs_left[request_id] -= 1
        if not self._outputs_left[request_id]:
            del self._outputs_left[request_id]
            self._finished.add(request_id)

    def _start_waiting(self) -> None:
        """Gather and submit queued jobs while every budget they need allows: for
        each of its outputs (Kafka, file) a job is gathered once."""
        while self._waiting and self._has_room(self._waiting[0], self._waiting[0].rows * self._row_bytes):
            job = self._waiting.popleft()
            to_kafka = job.params is not None and self._sender is not None
            to_file = job.file_path is not None and self._writer is not None
            self._outputs_left[job.engine_request_id] = to_kafka + to_file
            if to_kafka:
                assert self._sender is not None
                try:
                    self._sender.submit(job, self._gather(job, fp8=self._fp8_to_kafka))
                except Exception as exc:  # noqa: BLE001 - one bad request must not kill the engine
                    self._sender.fail(job, f"{type(exc).__name__}: {exc}")
            if to_file and not self._write_file(job):
                self._output_done(job.engine_request_id)

    def _write_file(self, job: SendJob) -> bool:
        """Hand the job's rows to the file writer; ``False`` when they could not
        be gathered (the file is then missing, counted and logged)."""
        assert self._writer is not None and job.file_path is not None
        try:
            gathered = self._gather(job, fp8=False)
        except Exception as exc:  # noqa: BLE001 - one bad request must not kill the engine
            self._writer.fail(job.file_path, f"gather failed: {type(exc).__name__}: {exc}")
            return False
        self._writer.write(job.engine_request_id, job.file_path, gathered, job.token_ids[job.first_row:],
                           job.finished_at)
        return True

    def _has_room(self, job: SendJob, nbytes: int) -> bool:
        return ((job.params is None or self._sender is None or self._sender.has_room(nbytes))
                and (job.file_path is None or self._writer is None or self._writer.has_room(nbytes)))

    def _gather(self, job: SendJob, *, fp8: bool) -> Gathered:
        """The job's rows on the host (fp8: quantized on the device, before the copy)."""
        if self._cuda is not None:
            return self._cuda.gather(self._cache, job.block_ids, len(job.token_ids), self._block_size, job.first_row,
                                     fp8=fp8)
        return gather_cpu(self._cache, job.block_ids, len(job.token_ids), self._block_size, job.first_row, fp8=fp8)
