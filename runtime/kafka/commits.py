"""Committing per-partition watermarks."""

from __future__ import annotations

import logging

from confluent_kafka import Consumer, KafkaException, TopicPartition

from hsx.runtime.kafka.watermarks import TopicPartitionKey, Watermarks
from hsx.runtime.metrics import commit_failures

log = logging.getLogger(__name__)


def as_offsets(positions: dict[TopicPartitionKey, int]) -> list[TopicPartition]:
    return [TopicPartition(topic, partition, offset) for (topic, partition), offset in positions.items()]


def commit_watermarks(consumer: Consumer, marks: Watermarks, only: set[TopicPartitionKey] | None = None) -> None:
    """Synchronously commit every position that moved (optionally only for some
    partitions), checking Kafka's answer for each partition:

    1. positions Kafka accepted are marked committed;
    2. a partition whose commit failed (its own error in the answer, or the whole
       request failed) stays marked as not committed, is logged and counted
       (``hsx_commit_failures``), and the next call retries it.
    """
    positions = {tp: o for tp, o in marks.to_commit().items() if only is None or tp in only}
    if not positions:
        return
    try:
        answer = consumer.commit(offsets=as_offsets(positions), asynchronous=False) or []
    except KafkaException as exc:
        failed = {tp: str(exc) for tp in positions}
    else:
        failed = {(tp.topic, tp.partition): tp.error.str() for tp in answer if tp.error is not None}
    for tp, reason in failed.items():
        log.warning("commit of %s-%d at %d failed (will retry): %s", tp[0], tp[1], positions[tp], reason)
        commit_failures.labels(tp[0], str(tp[1])).inc()
    marks.committed({tp: o for tp, o in positions.items() if tp not in failed})
    log.debug("committed %s", positions)


def partition_lag(consumer: Consumer) -> dict[TopicPartitionKey, int]:
    """Records between each assigned partition's fetch position and its end, from
    the watermarks librdkafka caches with every fetch (no broker round trip)."""
    lag = {}
    for tp in consumer.position(consumer.assignment()):
        try:
            _, high = consumer.get_watermark_offsets(tp, cached=True)
        except KafkaException:
            continue
        if tp.offset >= 0 and high >= 0:
            lag[(tp.topic, tp.partition)] = max(0, high - tp.offset)
    return lag


def remaining_lag(consumer: Consumer, partitions: list[TopicPartitionKey], timeout: float = 2.0) -> int | None:
    """Records not yet fetched on ``partitions``: from the fetch position, or,
    where the consumer has none (a partition assigned but never fetched, e.g.
    paused), from the group's committed offset, to each partition's end as the
    broker reports it now; ``None`` when the broker did not answer in ``timeout``
    seconds. (The position already skips transaction markers.)"""
    tps = [TopicPartition(t, p) for t, p in partitions]
    try:
        starts = {(tp.topic, tp.partition): tp.offset for tp in consumer.position(tps)}
        unknown = [tp for tp in tps if starts[(tp.topic, tp.partition)] < 0]
        if unknown:
            starts.update({(tp.topic, tp.partition): tp.offset for tp in consumer.committed(unknown, timeout=timeout)})
        lag = 0
        for tp in tps:
            low, high = consumer.get_watermark_offsets(tp, timeout=timeout, cached=False)
            start = starts[(tp.topic, tp.partition)]
            lag += max(0, high - (start if start >= 0 else low))
        return lag
    except KafkaException:
        return None
