"""``hsx serve --draft``'s live acceptance: the mean acceptance length of the
latest requests each draft version served, from what vLLM counted for each
request (the connector's :class:`~hsx.schemas.reports.SpeculationReport`), and
the rule that says a newly swapped-in draft does worse than the one before it.

A request's acceptance length is ``1 + accepted / verify steps``; a version's
window is its latest :data:`WINDOW` requests, whose mean weighs each request by
its steps (as vLLM's own counters do). Its noise is the standard error of the
per-request lengths; a version regressed when its window's mean is below the
previous version's by more than twice the two windows' combined error.
"""

from __future__ import annotations

import math
import threading
from collections import deque
from dataclasses import dataclass

from prometheus_client import Gauge

from hsx.schemas.reports import SpeculationReport

WINDOW = 64
"""Requests in a version's window."""

ACCEPTANCE = Gauge("hsx_serve_acceptance_length",
                   "Mean acceptance length of the latest requests each draft version served (vLLM's per-request "
                   "counts)", ["draft_version"])


@dataclass(frozen=True)
class Window:
    requests: int
    acceptance_length: float
    error: float
    """Standard error of the per-request acceptance lengths."""


class LiveAcceptance:
    """Per draft version: the latest requests' counts, and all of them. Thread-safe."""

    def __init__(self, window: int = WINDOW) -> None:
        self._window = window
        self._latest: dict[int, deque[tuple[int, int]]] = {}
        self._totals: dict[int, list[int]] = {}
        """Per version: requests, verify steps, accepted tokens."""
        self._lock = threading.Lock()

    def add(self, report: SpeculationReport) -> None:
        if not report.verify_steps:
            return  # finished before any draft was verified: nothing to say of the draft
        accepted = sum(report.accepted_per_position)
        with self._lock:
            latest = self._latest.setdefault(report.draft_version, deque(maxlen=self._window))
            latest.append((report.verify_steps, accepted))
            totals = self._totals.setdefault(report.draft_version, [0, 0, 0])
            totals[0] += 1
            totals[1] += report.verify_steps
            totals[2] += accepted
            window = self._window_of(latest)
        ACCEPTANCE.labels(str(report.draft_version)).set(window.acceptance_length)

    def window(self, version: int) -> Window | None:
        """``version``'s full window, or ``None`` while it has fewer requests."""
        with self._lock:
            latest = self._latest.get(version)
            if latest is None or len(latest) < self._window:
                return None
            return self._window_of(latest)

    def totals(self) -> dict[int, tuple[int, float]]:
        """Per version: requests and mean acceptance length over all of them."""
        with self._lock:
            return {v: (n, 1 + accepted / steps) for v, (n, steps, accepted) in sorted(self._totals.items())}

    @staticmethod
    def _window_of(latest: deque[tuple[int, int]]) -> Window:
        lengths = [1 + a / s for s, a in latest]
        mean = 1 + sum(a for _, a in latest) / sum(s for s, _ in latest)
        n = len(lengths)
        plain = sum(lengths) / n
        variance = sum((x - plain) ** 2 for x in lengths) / (n - 1) if n > 1 else 0.0
        return Window(n, mean, math.sqrt(variance / n))


def regressed(before: Window, after: Window) -> bool:
    """Whether ``after`` is worse than ``before`` by more than their noise."""
    return after.acceptance_length < before.acceptance_length - 2 * math.hypot(before.error, after.error)
