"""Prometheus metrics every consumer-group member has, named per service
(``hsx_extractor_consumer_lag``, ``hsx_sink_consumer_lag``, ...)."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

from prometheus_client import Counter, Gauge, Histogram


@dataclass(frozen=True)
class MemberMetrics:
    rebalances: Counter
    commit_seconds: Histogram
    lag: Gauge
    seconds_since_progress: Gauge


@cache  # a metric may be registered once per process
def member_metrics(service: str) -> MemberMetrics:
    prefix = f"hsx_{service}"
    return MemberMetrics(
        rebalances=Counter(f"{prefix}_rebalances", "Partition assignments, revocations and losses", ["kind"]),
        commit_seconds=Histogram(f"{prefix}_commit_seconds", "Offset commit latency"),
        lag=Gauge(f"{prefix}_consumer_lag", "Records behind the end of the partition", ["topic", "partition"]),
        seconds_since_progress=Gauge(f"{prefix}_seconds_since_progress",
                                     "With work pending, seconds since a record was fetched or finished (else 0)"),
    )


produced_records = Counter("hsx_produced_records", "Records produced, by delivery report outcome",
                           ["service", "topic", "outcome"])
"""Every record hsx produces ends here once: ``acked`` or ``refused`` (see hsx.runtime.kafka.producer)."""

kafka_errors = Counter("hsx_kafka_client_errors", "Transient errors Kafka clients reported (they retry)",
                       ["client", "kind"])

commit_failures = Counter("hsx_commit_failures", "Partitions whose offset commit failed (retried by the next commit)",
                          ["topic", "partition"])
