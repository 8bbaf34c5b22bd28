"""The blocks topic's partition count, recorded in the dataset and checked.

The sink de-duplicates per partition: every record of a request carries its id
as key, so with a fixed partition count a retry lands on the partition that
holds the first copy. When the topic gains partitions, ids hash elsewhere and a
retry of a stored request would be stored again. Rather than hold every
partition's keys in every sink (memory that grows with the dataset, and still
racing the sinks of other partitions), the dataset records the count on first
use (``topics/<topic>.json``, :class:`hsx.schemas.shard.TopicRecord`) and the sink
refuses to run on a topic whose count differs.
"""

from __future__ import annotations

from confluent_kafka import Producer
from pydantic import ValidationError

from hsx.dataset.shards import TOPICS, safe_name
from hsx.dataset.storage import Storage
from hsx.runtime.errors import HsxError, ServiceFailed
from hsx.schemas.shard import TopicRecord


class PartitionCountChanged(HsxError):
    """The blocks topic's partition count is not the one the dataset was written with."""


def record_path(topic: str) -> str:
    return f"{TOPICS}/{safe_name(topic)}.json"


def check_topic(producer: Producer, storage: Storage, topic: str, where: str) -> int:
    """:func:`check_partition_count` for ``topic`` as the broker's metadata has it
    (``topic`` exists). Returns the recorded count."""
    partitions = len(producer.list_topics(topic, timeout=30).topics[topic].partitions)
    if not partitions:  # the topic exists: metadata without partitions is the broker's fault
        raise ServiceFailed(f"the broker's metadata lists no partitions of {topic}; retry once it does")
    return check_partition_count(storage, topic, partitions, where)


def check_partition_count(storage: Storage, topic: str, partitions: int, where: str) -> int:
    """Record ``topic``'s partition count in a dataset that has none yet, or
    raise :class:`PartitionCountChanged` when it differs from the recorded one.
    ``where`` names the dataset in the message. Returns the recorded count."""
    path = record_path(topic)
    if path not in storage.list(TOPICS, starting=path.rsplit("/", 1)[-1]):
        storage.write_atomic(path, TopicRecord(topic=topic, partitions=partitions).model_dump_json().encode())
        return partitions
    try:
        recorded = TopicRecord.model_validate_json(storage.read(path))
    except ValidationError as exc:
        raise PartitionCountChanged(f"{where}/{path} is not a topic record ({exc.error_count()} errors): "
                                    f"restore it, or write to a new --output") from exc
    if recorded.partitions != partitions:
        raise refusal(where, topic, recorded.partitions, str(partitions))
    return recorded.partitions


def refusal(where: str, topic: str, recorded: int, now: str) -> PartitionCountChanged:
    """The one-line error for a changed partition count."""
    return PartitionCountChanged(
        f"{where} was written from {topic} with {recorded} partitions, but {topic} now has {now}: a retry of a "
        f"stored request could land on another partition and be stored twice. Write to a new --output (or sink "
        f"a topic with {recorded} partitions); delete {where}/{record_path(topic)} only if no request already "
        f"in the dataset can come again")
