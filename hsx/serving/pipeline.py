"""``hsx serve``'s dataset side (step 2 and the sink's part of step 6 of
:mod:`hsx.serving.command`): the broker's topics, the sink writing ``--output``, and the
ready events followed while serving, so that the drain waits only for the
samples still in flight; with ``--no-sink``, the cluster's blocks topic alone."""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hsx.running.ledger import NOT_TERMINAL, LedgerFeed
from hsx.local.commands import STEADY_SESSION_TIMEOUT_MS, sink_command
from hsx.local.spawn import HsxService
from hsx.running.command import SINK_FLUSH_WHEN_IDLE, broker, run_topics
from hsx.running.plan import own_staging_codec
from hsx.runtime.kafka import ensure_topics
from hsx.runtime.settings import KafkaSettings, TopicSettings
from hsx.schemas import ErrorClass, HiddenStatesReady
from hsx.serving.plan import ServePlan
from hsx.serving.reports import InFlight

log = logging.getLogger(__name__)

_ANNOUNCED = "announced"

ANNOUNCE_SECONDS = 120.0
"""After the server stopped, how long the sink may take to announce the samples
Kafka acknowledged before the rest counts as lost."""

UNCONFIRMED_SECONDS = 10.0
"""After those, how long samples promised with no report (the engine died; Kafka
may have acknowledged them a moment before) may take to be announced."""


@dataclass
class Drained:
    """What the dataset side says at the end (step 6)."""

    missing: set[str] = field(default_factory=set)
    """Acknowledged by Kafka, never announced."""
    unconfirmed: list[str] = field(default_factory=list)
    """Promised with no report (the engine died), never announced: lost."""
    dead: Counter[str] = field(default_factory=Counter)
    """Acknowledged, then dead-lettered by the sink, by error class: lost."""
    announced: int = 0

    @property
    def lost(self) -> int:
        return len(self.missing) + len(self.unconfirmed) + self.dead.total()


class Announcements:
    """The acknowledged samples the sink has yet to announce: an id is held from
    its acknowledgement (the connector's report) to its ready event or dead letter,
    whichever arrives first (:class:`InFlight`), so a server that runs for weeks
    holds only what is in flight."""

    def __init__(self) -> None:
        self._samples = InFlight()
        self._lock = threading.Lock()  # acknowledgements and ready events come on two threads
        self.announced = 0
        self.dead: Counter[str] = Counter()
        """Acknowledged samples the sink dead-lettered, by error class: lost."""
        self.foreign = 0

    def acknowledged(self, sample_id: str) -> None:
        if (outcome := self._samples.open(sample_id)) is not None:
            self._count(outcome)

    def record_ready(self, event: HiddenStatesReady) -> None:
        if self._samples.close(event.request_id, _ANNOUNCED):
            self._count(_ANNOUNCED)

    def record_dead_letter(self, request_id: str, error_class: ErrorClass) -> None:
        if error_class not in NOT_TERMINAL and self._samples.close(request_id, error_class.value):
            self._count(error_class.value)

    def _count(self, outcome: str) -> None:
        with self._lock:
            if outcome == _ANNOUNCED:
                self.announced += 1
            else:
                self.dead[outcome] += 1

    def missing(self) -> set[str]:
        """Acknowledged, neither announced nor dead-lettered (yet)."""
        return self._samples.held()

    def not_announced(self, unconfirmed: list[str]) -> list[str]:
        """Those of ``unconfirmed`` (never acknowledged to us) not announced so far."""
        return [s for s in unconfirmed if self._samples.closed_first(s) != _ANNOUNCED]


class DatasetSide:
    """The dataset side: a broker's topics and the sink writing ``--output`` (or,
    with ``--no-sink``, the cluster's blocks topic alone)."""

    def __init__(self, bootstrap: str, plan: ServePlan, logs: Path) -> None:
        self.kafka = KafkaSettings(bootstrap=bootstrap)
        self.topic_settings = run_topics(partitions=2) if plan.own_sink else TopicSettings()
        self.topics = self.topic_settings.topics()
        self.sink: HsxService | None = None
        self.announcements = Announcements()
        self._follower: threading.Thread | None = None
        self._stop = threading.Event()
        if plan.output is None:  # --no-sink
            ensure_topics(self.kafka, self.topic_settings, [self.topics.blocks])
            return
        ensure_topics(self.kafka, self.topic_settings, [self.topics.blocks, self.topics.blocks_dlq, self.topics.ready,
                                                        self.topics.prompts_dlq])
        transport = ["--payload-store", plan.staging] if plan.staging else []
        self.sink = HsxService("sink", sink_command(bootstrap, self.topic_settings, plan.output, "--flush-when-idle",
                                                    SINK_FLUSH_WHEN_IDLE, "--dataset-codec", plan.dataset_codec.value,
                                                    *transport, group=f"hsx-serve-{uuid.uuid4().hex[:8]}-sink",
                                                    session_timeout_ms=STEADY_SESSION_TIMEOUT_MS), logs,
                               with_parent=True).start()
        feed = LedgerFeed.connect(self.kafka, self.topics, self.announcements)
        self._follower = threading.Thread(target=self._follow, args=(feed,), name="hsx-serve-ready", daemon=True)
        self._follower.start()

    def _follow(self, feed: LedgerFeed) -> None:
        """The ready and dead-letter topics, read as they fill until :meth:`stop`."""
        try:
            while not self._stop.is_set():
                feed.poll(0.5)
        except Exception:  # KafkaFatal: the drain then counts every sample still in flight as not announced
            log.exception("following the ready topic failed")
        finally:
            feed.close()

    def connector_config(self, plan: ServePlan) -> dict[str, Any]:
        """The connector's Kafka side (``kv_connector_extra_config.hsx``)."""
        config: dict[str, Any] = {"bootstrap": self.kafka.bootstrap, "blocks_topic": self.topics.blocks}
        if plan.staging is not None:
            config["payload_store"] = plan.staging
            if (codec := own_staging_codec(plan.dataset_codec)) is not None:
                config["codec"] = codec.value
        if plan.model_name:
            config["model"] = plan.model_name
        return config

    def wait_announced(self, unconfirmed: list[str]) -> Drained:
        """Step 6, the sink's part (after every report was read): the acknowledged
        samples it has not announced within :data:`ANNOUNCE_SECONDS` (or before it
        or the follower of its ready events stopped), and those of ``unconfirmed``
        not announced within :data:`UNCONFIRMED_SECONDS` more (a sample announced
        later still was counted lost: an overcount, never a silent loss)."""
        if self.sink is None or self._follower is None:
            return Drained(unconfirmed=unconfirmed)  # the cluster's sinks announce them
        now = time.monotonic()
        deadline, settled = now + ANNOUNCE_SECONDS, None
        while now < deadline and self.sink.exited() is None and self._follower.is_alive():
            if not self.announcements.missing():
                settled = settled or now + UNCONFIRMED_SECONDS
                if now > settled or not self.announcements.not_announced(unconfirmed):
                    break
            time.sleep(0.2)
            now = time.monotonic()
        a = self.announcements
        return Drained(a.missing(), a.not_announced(unconfirmed), Counter(a.dead), a.announced)

    def stop(self) -> list[str]:
        self._stop.set()
        if self._follower is not None:
            self._follower.join(10)
        if self.sink is None:
            return []
        status = self.sink.stop(timeout=300) if self.sink.exited() is None else self.sink.exited()
        return [] if status == 0 else [f"sink exited with {status} (log: {self.sink.log_path()})"]


@contextmanager
def dataset_side(plan: ServePlan, logs: Path) -> Iterator[DatasetSide]:
    with broker(plan.bootstrap) as bootstrap:
        pipeline = DatasetSide(bootstrap, plan, logs)
        try:
            yield pipeline
        finally:
            if pipeline.sink is not None and pipeline.sink.exited() is None:
                pipeline.sink.kill()
