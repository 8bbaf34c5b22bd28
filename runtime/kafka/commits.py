"""Committing per-partition watermarks."""

from __future__ import annotations

import logging

from confluent_kafka import Consumer, KafkaException, TopicPartition

from runtime.kafka.watermarks import TopicPartitionKey, Watermarks

log = logging.getLogger(__name__)


def as_offsets(positions: dict[TopicPartitionKey, int]) -> list[TopicPartition]:
    return [TopicPartition(topic, partition, offset) for (topic, partition), offset in positions.items()]


def commit_watermarks(consumer: Consumer, marks: Watermarks, only: set[TopicPartitionKey] | None = None) -> None:
    """Synchronously commit every position that moved (optionally only for some
    partitions). A failed commit is logged and retried by the next call: the
    positions stay marked as not committed."""
    positions = {tp: o for tp, o in marks.to_commit().items() if only is None or tp in only}
    if not positions:
        return
    try:
        consumer.commit(offsets=as_offsets(positions), asynchronous=False)
    except KafkaException as exc:
        log.warning("commit failed (will retry): %s", exc)
        return
    marks.committed(positions)
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
