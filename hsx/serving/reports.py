"""``hsx serve``'s side of the report channel: the connector, inside vLLM's
engine, pushes a report per promise (a response named a file or a sample) and
per capture (a file complete or failed, a sample acknowledged by Kafka or
failed); this turns them into Prometheus metrics and the summary's counts,
holds each promise until its capture's report (what is still held when the
engine is gone was lost), and hands each acknowledged sample's id on (to the
wait for its ready event).

ZeroMQ PULL on an ``ipc://`` socket, bound here; the connector connects and
pushes (:class:`hsx.extractor.completion.CompletionSender`).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import zmq
from prometheus_client import Counter, Gauge, Histogram
from pydantic import TypeAdapter, ValidationError

from hsx.schemas.reports import (
    CompletionReport,
    DraftSwapReport,
    FileReport,
    KafkaState,
    PromiseReport,
    Report,
    SpeculationReport,
)
from hsx.serving.acceptance import LiveAcceptance

log = logging.getLogger(__name__)

_REPORT: TypeAdapter[Report] = TypeAdapter(Report)
LAG_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0)

CAPTURES = Counter("hsx_serve_captures",
                   "Captures handed on, by output (file, sample) and outcome (ok, failed, lost: promised in a "
                   "response, then the engine was gone before its capture's report; orphaned: a file an earlier "
                   "server on the directory promised, found at the start)", ["output", "outcome"])
CAPTURE_BYTES = Counter("hsx_serve_capture_bytes", "Raw hidden-state bytes of the captures handed on", ["output"])
CAPTURE_LAG = Histogram("hsx_serve_capture_lag_seconds",
                        "From a request's response to its file complete or its sample acknowledged by Kafka",
                        ["output"], buckets=LAG_BUCKETS)

KAFKA_IN_FLIGHT = Gauge("hsx_serve_kafka_in_flight_bytes", "Raw hidden-state bytes sent to Kafka, not yet acknowledged")
KAFKA_UNACKNOWLEDGED = Gauge("hsx_serve_kafka_unacknowledged_seconds",
                             "Since Kafka last acknowledged a capture's record, while any is in flight (else 0)")
BACKPRESSURE = Gauge("hsx_serve_backpressure_seconds",
                     "Since captures first waited for room in the in-flight budget, while they still do (else 0): "
                     "finished requests keep their blocks, so vLLM admits fewer")

DRAFT_VERSION = Gauge("hsx_serve_draft_version", "The draft version the engine serves (0: the one it started with)")
DRAFT_SWAPS = Counter("hsx_serve_draft_swaps", "Promoted drafts the engine took up (swapped) or refused, with the reason "
                      "logged", ["outcome"])

STALL_SECONDS = 5.0
"""Kafka silent this long with captures in flight: readiness says so."""

LAG_WINDOW = 100_000
"""Captures whose lags the summary's quantiles are taken over (the latest):
a server runs for weeks, and its memory stays bounded."""


class InFlight:
    """Ids between two events that may arrive in either order (a promise and its
    capture's report come from two processes; an acknowledgement and its ready
    event from two services). An id is held until both were seen, so what is held
    is what is in flight. Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._opened: set[str] = set()
        self._closed_first: dict[str, str] = {}
        """Closed before opened, with how (bounded by failures: a close nobody opens
        is a capture that failed before it was promised)."""

    def open(self, key: str) -> str | None:
        """The first event: ``None`` (now held), or how it was closed already."""
        with self._lock:
            outcome = self._closed_first.pop(key, None)
            if outcome is None:
                self._opened.add(key)
            return outcome

    def close(self, key: str, outcome: str) -> bool:
        """The second event: whether ``key`` was held (else it is remembered, with
        ``outcome``, for its :meth:`open`)."""
        with self._lock:
            if key in self._opened:
                self._opened.discard(key)
                return True
            self._closed_first.setdefault(key, outcome)
            return False

    def held(self) -> set[str]:
        with self._lock:
            return set(self._opened)

    def closed_first(self, key: str) -> str | None:
        """How ``key`` was closed, if it was closed before any :meth:`open`."""
        with self._lock:
            return self._closed_first.get(key)


@dataclass
class Tally:
    """What the reports said so far, by output."""

    ok: int = 0
    failed: int = 0
    raw_bytes: int = 0
    promised: InFlight = field(default_factory=InFlight)
    """Named in responses, no capture report yet."""
    lost: list[str] = field(default_factory=list)
    """Promised, and the engine was gone before the capture's report (:meth:`ReportReceiver.close`)."""
    unreported: int = 0
    """Promised, the engine gone before the report, and found all the same (a
    whole file under its name, a sample in the dataset): counted in ``ok``."""
    lags: deque[float] = field(default_factory=lambda: deque(maxlen=LAG_WINDOW))
    errors: list[str] = field(default_factory=list)
    """The first few failures' reasons, for the summary."""

    def add(self, ok: bool, raw_bytes: int, seconds: float | None, error: str | None) -> None:
        if ok:
            self.ok += 1
            self.raw_bytes += raw_bytes
            if seconds is not None:
                self.lags.append(seconds)
        else:
            self.failed += 1
            if len(self.errors) < 5:
                self.errors.append(error or "unknown")

    def lag_quantile(self, q: float) -> float | None:
        """The ``q`` quantile of the latest :data:`LAG_WINDOW` captures' lags."""
        if not self.lags:
            return None
        ordered = sorted(self.lags)
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


class ReportReceiver:
    """Receives the connector's reports on a thread of its own."""

    def __init__(self, directory: Path, acknowledged: Callable[[str], None] = lambda _: None) -> None:
        self.address = f"ipc://{directory / 'reports.sock'}"
        self._socket = zmq.Context.instance().socket(zmq.PULL)
        self._socket.bind(self.address)
        self._lock = threading.Lock()
        self.files = Tally()
        self.samples = Tally()
        self.kafka_state: tuple[KafkaState, float] | None = None
        """The connector's latest word on its Kafka side, and when it came."""
        self.drafts: list[DraftSwapReport] = []
        """Each promoted draft the engine swapped in or refused, in order."""
        self.acceptance = LiveAcceptance()
        """Live acceptance per draft version, serving with a draft."""
        self.earlier: list[str] = []
        """Files an earlier server on the directory promised and died before writing (found at the start)."""
        self._acknowledged = acknowledged
        """Called with each sample id Kafka acknowledged: each must reach the dataset."""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._receive, name="hsx-serve-reports", daemon=True)
        self._thread.start()

    def _receive(self) -> None:
        while not self._stop.is_set():
            if not self._socket.poll(200):
                continue
            raw = self._socket.recv()
            try:
                self._count(raw)
            except ValidationError as exc:  # our own connector's: a bug, never a reason to stop serving
                log.error("unreadable capture report %r: %s", raw[:200], exc)

    def _count(self, raw: bytes) -> None:
        report = _REPORT.validate_json(raw)
        if isinstance(report, KafkaState):
            self._kafka(report)
            return
        if isinstance(report, DraftSwapReport):
            self._draft(report)
            return
        if isinstance(report, SpeculationReport):
            self.acceptance.add(report)
            return
        if isinstance(report, PromiseReport):
            for key, tally in ((report.path, self.files), (report.sample_id, self.samples)):
                if key is not None:
                    tally.promised.open(key)
            return
        if isinstance(report, FileReport) and report.earlier:
            with self._lock:
                self.earlier.append(report.path)
            CAPTURES.labels("file", "orphaned").inc()
            return
        output, tally = ("file", self.files) if isinstance(report, FileReport) else ("sample", self.samples)
        key = report.path if isinstance(report, FileReport) else report.request_id
        tally.promised.close(key, "ok" if report.ok else "failed")
        if not report.ok:  # named here, once: the tally keeps counts only
            log.error("%s %s lost: %s", output, key, report.error)
        with self._lock:
            tally.add(report.ok, report.raw_bytes, report.seconds, report.error)
        if isinstance(report, CompletionReport) and report.ok:
            self._acknowledged(report.request_id)
        CAPTURES.labels(output, "ok" if report.ok else "failed").inc()
        if report.ok:
            CAPTURE_BYTES.labels(output).inc(report.raw_bytes)
            if report.seconds is not None:
                CAPTURE_LAG.labels(output).observe(report.seconds)

    def draft_rows(self, initial: str) -> list[tuple[str, str]]:
        """The summary's rows on drafts, serving with ``initial`` first."""
        swapped = [d for d in self.drafts if d.outcome == "swapped"]
        refused = [d for d in self.drafts if d.outcome == "refused"]
        by_version = ", ".join(f"{v}: {mean:.2f} ({n:,} requests)" for v, (n, mean) in self.acceptance.totals().items())
        return [("draft served last", f"{swapped[-1].version} ({swapped[-1].path})" if swapped else f"0 ({initial})"),
                ("drafts swapped in", f"{len(swapped):,}"),
                ("drafts refused", f"{len(refused):,}" + (f": {refused[-1].reason}" if refused else "")),
                ("acceptance length by draft", by_version or "-")]

    def _draft(self, report: DraftSwapReport) -> None:
        with self._lock:
            self.drafts.append(report)
        DRAFT_SWAPS.labels(report.outcome).inc()
        if report.outcome == "swapped":
            DRAFT_VERSION.set(report.version)
            log.info("serving draft %d (%s)", report.version, report.path)
        else:
            log.error("draft %d (%s) refused, the server keeps its draft: %s", report.version, report.path,
                      report.reason)

    def _kafka(self, state: KafkaState) -> None:
        KAFKA_IN_FLIGHT.set(state.in_flight_bytes)
        KAFKA_UNACKNOWLEDGED.set(state.unacknowledged_s)
        BACKPRESSURE.set(state.full_s)
        before, self.kafka_state = self.kafka_condition(), (state, time.monotonic())
        after = self.kafka_condition()
        if after is not None and before is None:
            log.warning("%s", after)
        elif after is None and before is not None:
            log.info("Kafka keeps up again")

    def kafka_condition(self) -> str | None:
        """What readiness says of the Kafka side: ``None`` while it keeps up (or
        the engine said nothing for :data:`STALL_SECONDS`: it has nothing to send)."""
        if self.kafka_state is None or time.monotonic() - self.kafka_state[1] > STALL_SECONDS:
            return None
        state = self.kafka_state[0]
        waiting = (f"{state.in_flight:,} captures ({state.in_flight_bytes / 2**20:,.1f} MiB) in flight, nothing "
                   f"acknowledged for {state.unacknowledged_s:.0f} s")
        if state.full_s > 0:
            return f"slowed by backpressure: captures wait for Kafka, so requests wait for cache blocks ({waiting})"
        if state.unacknowledged_s >= STALL_SECONDS:
            return f"answering, Kafka behind: {waiting}; requests slow once the in-flight budget is full"
        return None

    def close(self) -> None:
        """1. Stop the receiving thread; 2. read what is still queued; 3. every
        promise still held is lost (a file) or unconfirmed (a sample, until
        :meth:`settle_samples`): called once vLLM's engine is gone, so no report
        can come for it (later calls do nothing)."""
        if self._socket.closed:
            return
        self._stop.set()
        self._thread.join(5)
        while self._socket.poll(0):
            self._count(self._socket.recv())
        self._socket.close(linger=0)
        # A file under its final name is whole (written, then renamed): its writer died before reporting it.
        unreported = sorted(self.files.promised.held())
        self._settle("file", self.files, unreported, [path for path in unreported if not os.path.exists(path)])
        self.samples.lost = sorted(self.samples.promised.held())

    def settle_samples(self, lost: list[str]) -> None:
        """4. Of the samples promised with no report (:meth:`close`), those still
        lost once the dataset side had its say (a sample Kafka acknowledged just
        before the engine died reaches the dataset all the same)."""
        self._settle("sample", self.samples, self.samples.lost, lost)

    def _settle(self, output: str, tally: Tally, unreported: list[str], lost: list[str]) -> None:
        """Of ``unreported`` (promised, no report), ``lost``; the others were found, so captured."""
        found = len(unreported) - len(lost)
        with self._lock:
            tally.lost, tally.unreported = lost, found
            tally.ok += found
        CAPTURES.labels(output, "lost").inc(len(lost))
        CAPTURES.labels(output, "ok").inc(found)
