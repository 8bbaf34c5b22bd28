"""The first samples of a ready stream, read before ``hsx train-draft`` builds
its draft: their events (the stream's layer layout) and the counts of the tokens
under their loss masks (the draft vocabulary, as speculators counts an export's)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import torch
from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaException, TopicPartition

from hsx.dataset.encoding import read_token_ids
from hsx.dataset.reader import ShardHandles
from hsx.runtime.errors import ServiceFailed
from hsx.runtime.kafka import ConsumerErrors, consumer_config
from hsx.runtime.kafka.config import METADATA_TIMEOUT_S
from hsx.runtime.recent import RecentKeys
from hsx.runtime.settings import KafkaSettings
from hsx.schemas import HiddenStatesReady
from hsx.schemas.training import LossMaskPolicy
from hsx.trainer.consume import ready_event, records_until_idle
from hsx.trainer.samples import check_trainable, loss_mask

POLL_S = 0.5


@dataclass
class FirstSamples:
    """What the first samples of the stream say, read before the draft is built."""

    events: list[HiddenStatesReady] = field(default_factory=list)
    token_freq: Counter[int] = field(default_factory=Counter)
    """Tokens under the loss mask, counted as speculators' ``save_token_frequency_distribution`` does."""


def first_samples(kafka: KafkaSettings, topic: str, group: str, shards: ShardHandles, count: int,
                  policy: LossMaskPolicy, idle_timeout: float | None) -> FirstSamples:
    """The first ``count`` trainable samples from where the job's group stands
    (the start of the log for a new group), or fewer when ``idle_timeout``
    passes without a record. Reads each sample's token ids and mask, not its
    hidden states, and commits nothing: training starts from the same place."""
    consumer = Consumer(consumer_config(kafka, group))
    found = FirstSamples()
    try:
        try:
            partitions = consumer.list_topics(topic, timeout=METADATA_TIMEOUT_S).topics[topic].partitions
            committed = consumer.committed([TopicPartition(topic, p) for p in partitions], timeout=METADATA_TIMEOUT_S)
        except KafkaException as exc:
            raise ServiceFailed(f"Kafka at {kafka.bootstrap}: {exc.args[0]}") from None
        consumer.assign([TopicPartition(topic, tp.partition, tp.offset if tp.offset >= 0 else OFFSET_BEGINNING)
                         for tp in committed])
        seen = RecentKeys(100_000)
        for message in records_until_idle(consumer, ConsumerErrors("train-draft"), POLL_S, idle_timeout,
                                          lambda: len(found.events) >= count):
            try:
                event = ready_event(message)
            except ValueError as exc:  # before training starts, the job cannot go on without its samples
                raise ServiceFailed(str(exc)) from None
            if not seen.add(event.event_id):
                continue
            check_trainable(event)
            shard = shards.get(event.shard)
            mask = loss_mask(shard, event, policy).to(torch.bool)
            if not bool(mask.any()):
                continue  # the stream skips it too
            ids, counts = read_token_ids(shard, event)[mask].unique(return_counts=True)
            found.token_freq.update(dict(zip(ids.tolist(), counts.tolist(), strict=True)))
            found.events.append(event)
    finally:
        consumer.close()
    return found
