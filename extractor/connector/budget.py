"""The Kafka side's in-flight budget: raw hidden-state bytes handed to the
:class:`~hsx.extractor.connector.sender.BlockSender` and not yet acknowledged,
bounded by ``max_inflight_bytes``; which requests vLLM may free; and what
``hsx serve`` is told of it every second (:class:`KafkaState`).

Thread-safe: vLLM's worker thread admits and takes, the poller and delivery
threads settle. Its lock is only ever taken alone or inside a transfer's lock.
"""

from __future__ import annotations

import threading
import time

from hsx.schemas.reports import KafkaState


class Budget:
    """Transfers admitted and not yet settled, their bytes, and the finished ones."""

    def __init__(self, max_bytes: int) -> None:
        self._max_bytes = max_bytes
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._count = 0
        self._bytes = 0
        self._finished: set[str] = set()
        self._last_ack = time.monotonic()
        self._full_since: float | None = None

    def has_room(self, nbytes: int) -> bool:
        """Whether a request of ``nbytes`` raw bytes fits (one request always fits
        when nothing else is in flight); a refusal starts the backpressure clock."""
        with self._lock:
            room = self._count == 0 or self._bytes + nbytes <= self._max_bytes
            self._full_since = None if room else self._full_since or time.monotonic()
            return room

    def admit(self, nbytes: int) -> None:
        with self._lock:
            if self._count == 0:
                self._last_ack = time.monotonic()  # waiting starts now, not at the last acknowledgement
            self._count += 1
            self._bytes += nbytes

    def acked(self) -> None:
        """Kafka acknowledged a record (of any transfer)."""
        self._last_ack = time.monotonic()

    def settle(self, engine_request_id: str, nbytes: int) -> None:
        """A transfer ended (acknowledged or failed): vLLM may free its blocks."""
        with self._lock:
            self._count -= 1
            self._bytes -= nbytes
            self._finished.add(engine_request_id)
            self._idle.notify_all()

    def never_admitted(self, engine_request_id: str) -> None:
        """A job given up before it was admitted: vLLM may free its blocks."""
        with self._lock:
            self._finished.add(engine_request_id)

    def take_finished(self) -> set[str]:
        """Engine request ids settled since the last call."""
        with self._lock:
            finished, self._finished = self._finished, set()
        return finished

    def wait_idle(self, timeout: float) -> int:
        """Wait up to ``timeout`` for every transfer to settle; how many did not."""
        with self._idle:
            self._idle.wait_for(lambda: self._count == 0, timeout)
            return self._count

    def state(self, now: float) -> KafkaState:
        with self._lock:
            return KafkaState(in_flight=self._count, in_flight_bytes=self._bytes,
                              unacknowledged_s=now - self._last_ack if self._count else 0.0,
                              full_s=now - self._full_since if self._full_since is not None else 0.0)
