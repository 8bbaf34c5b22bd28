"""``hsx serve``'s dataset side (step 2 and the sink's part of step 6 of
:mod:`hsx.serve`): the broker's topics, the sink writing ``--output``, and the
wait for every acknowledged sample's ready event; with ``--no-sink``, the
cluster's blocks topic alone."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from hsx.ledger import Ledger, LedgerFeed
from hsx.local.commands import STEADY_SESSION_TIMEOUT_MS, sink_command
from hsx.local.spawn import HsxService
from hsx.run import SINK_FLUSH_WHEN_IDLE, broker, run_topics
from hsx.run_plan import own_staging_codec
from hsx.runtime.kafka import ensure_topics
from hsx.runtime.settings import KafkaSettings, TopicSettings
from hsx.serve_plan import ServePlan

ANNOUNCE_SECONDS = 120.0
"""After the server stopped, how long the sink may take to announce the samples
Kafka acknowledged before the rest counts as lost."""


class DatasetSide:
    """The dataset side: a broker's topics and the sink writing ``--output`` (or,
    with ``--no-sink``, the cluster's blocks topic alone)."""

    def __init__(self, bootstrap: str, plan: ServePlan, logs: Path) -> None:
        self.kafka = KafkaSettings(bootstrap=bootstrap)
        self.topic_settings = run_topics(partitions=2) if plan.own_sink else TopicSettings()
        self.topics = self.topic_settings.topics()
        self.sink: HsxService | None = None
        self.feed: LedgerFeed | None = None
        self.ledger = Ledger()
        if plan.output is None:  # --no-sink
            ensure_topics(self.kafka, self.topic_settings, [self.topics.blocks])
            return
        ensure_topics(self.kafka, self.topic_settings, [self.topics.blocks, self.topics.blocks_dlq, self.topics.ready,
                                                        self.topics.prompts_dlq])
        transport = ["--payload-store", plan.staging] if plan.staging else []
        self.sink = HsxService("sink", sink_command(bootstrap, self.topic_settings, plan.output, "--flush-when-idle",
                                                    SINK_FLUSH_WHEN_IDLE, "--dataset-codec", plan.dataset_codec.value,
                                                    *transport, group=f"hsx-serve-{uuid.uuid4().hex[:8]}-sink",
                                                    session_timeout_ms=STEADY_SESSION_TIMEOUT_MS), logs).start()
        self.feed = LedgerFeed(self.kafka, self.topics, self.ledger)

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

    def wait_announced(self, sent: set[str]) -> set[str]:
        """Step 6, the sink's part: the acknowledged samples it has not announced
        within :data:`ANNOUNCE_SECONDS` (or before it exited)."""
        if self.sink is None or self.feed is None:
            return set()  # the cluster's sinks announce them
        self.ledger.published = set(sent)
        deadline = time.monotonic() + ANNOUNCE_SECONDS
        while self.ledger.missing and time.monotonic() < deadline and self.sink.exited() is None:
            self.feed.poll(0.5)
        return self.ledger.missing

    def stop(self) -> list[str]:
        if self.sink is None or self.feed is None:
            return []
        self.feed.close()
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
