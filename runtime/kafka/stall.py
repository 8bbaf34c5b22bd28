"""Whether a group member is stuck: work pending and no progress for too long.

The member reports progress (a record fetched or done) and, once per loop tick,
what is pending; the health server's thread asks :meth:`StallWatch.liveness`.
"""

from __future__ import annotations

import time

from confluent_kafka import Consumer
from prometheus_client import Gauge

from hsx.runtime.kafka.commits import remaining_lag
from hsx.runtime.kafka.watermarks import TopicPartitionKey

LAG_CHECK_S = 5.0
"""How often the broker is asked for the lag while nothing is in flight."""


class StallWatch:
    """The stall clock of one member: it runs only while work is pending."""

    def __init__(self, stall_timeout: float, gauge: Gauge, lag_check_s: float = LAG_CHECK_S) -> None:
        self.stall_timeout = stall_timeout
        self._gauge = gauge
        self._lag_check_s = lag_check_s
        self._last_progress = self._lag_checked = time.monotonic()
        self._lag = 0
        self._pending = False

    def progress(self) -> None:
        """A record was fetched or finished."""
        self._last_progress = time.monotonic()

    def update(self, now: float, in_flight: int, consumer: Consumer, assigned: set[TopicPartitionKey]) -> None:
        """Whether work is pending: records fetched and not done (``in_flight``),
        or (asked of the broker every few seconds while nothing is in flight, so a
        member that stopped fetching is seen too) records not yet fetched on
        ``assigned`` partitions. While nothing is pending the clock does not run."""
        if in_flight == 0 and now - self._lag_checked >= self._lag_check_s:
            self._lag_checked = now
            lag = remaining_lag(consumer, sorted(assigned)) if assigned else 0
            if lag is not None:
                self._lag = lag
        self._pending = in_flight > 0 or (self._lag > 0 and bool(assigned))
        if not self._pending:
            self._last_progress = now
        self._gauge.set(now - self._last_progress)

    def liveness(self) -> tuple[bool, str]:
        """/healthz: failing once work has been pending for ``stall_timeout``
        seconds without progress, so the orchestrator restarts a stuck service.
        Reads only plain fields: the health thread must not wait behind the loop."""
        quiet = time.monotonic() - self._last_progress
        if self._pending and quiet > self.stall_timeout:
            return False, (f"stalled: work pending and no record fetched or finished for {quiet:.0f}s "
                           f"(--stall-timeout {self.stall_timeout:.0f})")
        return True, "ok"
