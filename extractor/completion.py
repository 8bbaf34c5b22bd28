"""The completion channel: how the connector, inside vLLM's engine process,
tells the extractor that a request attempt's records are all acknowledged by
Kafka (or failed). vLLM hands outputs back *before* the connector has sent
anything, so this channel, not the output, is what "done" means.

ZeroMQ PUSH (connector, connects) → PULL (extractor, binds) on an ``ipc://``
socket: reliable and ordered between two local processes; pyzmq ships with vLLM.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from pathlib import Path

import zmq
import zmq.asyncio
from pydantic import ValidationError

from hsx.schemas.reports import CompletionReport, FileReport, Report

log = logging.getLogger(__name__)


class CompletionSender:
    """Connector side. Thread-safe: reports come from delivery-callback threads.

    Without an address (vLLM's server with no ``hsx serve`` around it) no one
    listens: a failed attempt is logged, as the one trace of a lost capture."""

    def __init__(self, address: str | None) -> None:
        self._address = address
        self._lock = threading.Lock()
        self._socket: zmq.Socket | None = None

    def send(self, report: Report) -> None:
        if self._address is None:
            if isinstance(report, CompletionReport | FileReport) and not report.ok:
                what = report.path if isinstance(report, FileReport) else report.request_id
                log.error("capture of %s lost: %s", what, report.error)
            return
        with self._lock:
            if self._socket is None:
                self._socket = zmq.Context.instance().socket(zmq.PUSH)
                # Reports are tiny and must not be dropped: wait on close for them.
                self._socket.setsockopt(zmq.LINGER, 5000)
                self._socket.connect(self._address)
            self._socket.send(report.model_dump_json().encode())

    def close(self) -> None:
        with self._lock:
            if self._socket is not None:
                self._socket.close()
                self._socket = None


class CompletionReceiver:
    """Extractor side: resolves one future per expected attempt id."""

    def __init__(self, directory: Path) -> None:
        self.address = f"ipc://{directory / 'completions.sock'}"
        self._context = zmq.asyncio.Context()
        self._socket = self._context.socket(zmq.PULL)
        self._socket.bind(self.address)
        self._waiting: dict[str, asyncio.Future[CompletionReport]] = {}
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._receive())

    def expect(self, attempt_id: str) -> asyncio.Future[CompletionReport]:
        """A future resolved when the report for ``attempt_id`` arrives."""
        future: asyncio.Future[CompletionReport] = asyncio.get_running_loop().create_future()
        self._waiting[attempt_id] = future
        return future

    def fail_all(self, error: BaseException) -> None:
        """Fail every outstanding wait (the engine died: no report will come)."""
        waiting, self._waiting = self._waiting, {}
        for future in waiting.values():
            if not future.done():
                future.set_exception(error)

    def forget(self, attempt_id: str) -> None:
        self._waiting.pop(attempt_id, None)

    async def _receive(self) -> None:
        while True:
            raw = await self._socket.recv()
            try:
                report = CompletionReport.model_validate_json(raw)
            except ValidationError as exc:
                log.error("unreadable completion report dropped: %s", exc)
                continue
            future = self._waiting.pop(report.attempt_id, None)
            if future is None:
                # An attempt we gave up on (timeout) or a revoked partition's.
                log.info("late completion for %s (attempt %s) ignored", report.request_id, report.attempt_id)
            elif not future.done():
                future.set_result(report)

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self._socket.close(linger=0)
        self._context.term()
