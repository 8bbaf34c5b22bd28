"""The worker side of :class:`hsx.trainer.online.ReadyStream`: one Kafka consumer per
DataLoader worker, assigned its own share of the partitions, resolving each
ready event to its sample through a bounded shuffle buffer."""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from confluent_kafka import Consumer, KafkaException, Message, TopicPartition
from pydantic import ValidationError

from hsx.dataset.reader import ShardHandles
from hsx.runtime.kafka import ConsumerErrors, consumer_config
from hsx.runtime.kafka.config import METADATA_TIMEOUT_S
from hsx.runtime.recent import RecentKeys
from hsx.runtime.settings import KafkaSettings
from hsx.schemas import HiddenStatesReady, format_validation_error
from hsx.schemas.training import LossMaskPolicy
from hsx.trainer.holdout import held_out
from hsx.trainer.offsets import Position, Progress
from hsx.trainer.samples import LayerLayout, TrainingSample, check_trainable, choose_layers, loss_mask, read_sample


@dataclass
class ConsumeOptions:
    """What every worker of one stream shares (pickled into each worker)."""

    kafka: KafkaSettings
    topic: str
    group_id: str
    layers: list[int] | None
    policy: LossMaskPolicy
    shuffle_buffer: int
    seed: int
    idle_timeout: float | None
    dedupe_window: int
    until_end: bool = False
    """Stop once every partition is caught up with its end as the last fetch saw
    it: one pass over what is published (tests, benchmarks, a bounded epoch)."""
    holdout: float = 0.0
    """The share of sample ids kept out of training (:mod:`hsx.trainer.holdout`): skipped, their offsets consumed."""
    poll_timeout: float = 0.5


@dataclass
class _Pending:
    """A sample in the shuffle buffer: its event and mask, not its hidden states,
    so the buffer's memory is a few hundred bytes per sample."""

    event: HiddenStatesReady
    position: Position
    mask: torch.Tensor


def my_partitions(partitions: list[int], slot: int, slots: int) -> list[int]:
    """Partition ``p`` goes to consumer slot ``p % slots``: every partition to
    exactly one (rank, worker), without a group rebalance."""
    return [p for p in sorted(partitions) if p % slots == slot]


def _starts(consumer: Consumer, opts: ConsumeOptions, mine: list[int],
            progress: Progress) -> dict[int, tuple[int, set[int]]]:
    """Each partition's first offset and the offsets to skip: the trainer's
    progress (a loaded checkpoint, or what this process consumed before) or the
    group's commit, whichever is further (a persistent worker's copy of the
    progress is as old as the worker), else the start of the log."""
    starts: dict[int, tuple[int, set[int]]] = {}
    committed = consumer.committed([TopicPartition(opts.topic, p) for p in mine], timeout=METADATA_TIMEOUT_S)
    for tp in committed:
        known = progress.start(tp.partition)
        if known is not None and known[0] >= tp.offset:
            starts[tp.partition] = known
        elif tp.offset >= 0:
            skip = set() if known is None else {o for o in known[1] if o >= tp.offset}
            starts[tp.partition] = (tp.offset, skip)
        else:  # nothing committed yet: a new job reads from the start
            low, _high = consumer.get_watermark_offsets(TopicPartition(opts.topic, tp.partition),
                                                        timeout=METADATA_TIMEOUT_S)
            starts[tp.partition] = (low, set())
    return starts


def ready_event(message: Message) -> HiddenStatesReady:
    """The ``hidden_states.ready`` event a record holds; ``ValueError`` naming
    the record and the rule it breaks."""
    try:
        return HiddenStatesReady.model_validate_json(message.value() or b"")
    except ValidationError as exc:
        raise ValueError(f"{message.topic()}[{message.partition()}]@{message.offset()}: not a ready event: "
                         f"{format_validation_error(exc)}") from None


def records_until_idle(consumer: Consumer, errors: ConsumerErrors, poll_timeout: float, idle_timeout: float | None,
                       done: Callable[[], bool] | None = None) -> Iterator[Message]:
    """The records ``consumer`` polls, until ``idle_timeout`` seconds pass without
    one (``None``: never) or ``done()`` says so (asked before each poll). Errors
    go to ``errors``: a fatal one raises, transient ones are counted (librdkafka retries)."""
    last_record = time.monotonic()
    while done is None or not done():
        message = consumer.poll(poll_timeout)
        if message is None:
            if idle_timeout is not None and time.monotonic() - last_record >= idle_timeout:
                return
            continue
        if message.error() is not None:
            errors.check(message.error())
            continue
        last_record = time.monotonic()
        yield message


def consume(opts: ConsumeOptions, shards: ShardHandles, progress: Progress, slot: int,
            slots: int) -> Iterator[TrainingSample]:
    """Yield this slot's samples until ``idle_timeout`` passes without a record,
    or with ``until_end`` until every partition is caught up (else for ever);
    then the buffer is emptied, in random order."""
    consumer = Consumer(consumer_config(opts.kafka, opts.group_id))
    try:
        try:
            topic = consumer.list_topics(opts.topic, timeout=METADATA_TIMEOUT_S).topics.get(opts.topic)
        except KafkaException as exc:
            raise ConnectionError(f"Kafka at {opts.kafka.bootstrap}: {exc.args[0]}") from None
        if topic is None or topic.error is not None or not topic.partitions:
            raise ValueError(f"topic {opts.topic}: not found at {opts.kafka.bootstrap}")
        mine = my_partitions(list(topic.partitions), slot, slots)
        if not mine:
            return
        starts = _starts(consumer, opts, mine, progress)
        consumer.assign([TopicPartition(opts.topic, p, starts[p][0]) for p in mine])
        yield from _loop(consumer, opts, shards, starts, random.Random(opts.seed * 1_000_003 + slot))
    finally:
        consumer.close()


def _caught_up(consumer: Consumer, topic: str, read: dict[int, int]) -> bool:
    """Every partition read up to its end: the end is the high watermark of the
    last fetch response (cached: a broker's answer to a watermark query can lag,
    as the embedded dev broker's does), the read position the records seen
    (``read``) or the consumer's position, which also moves past transaction
    markers."""
    for tp in consumer.position([TopicPartition(topic, p) for p in read]):
        _low, high = consumer.get_watermark_offsets(tp, cached=True)
        if high < 0 or max(tp.offset, read[tp.partition]) < high:
            return False
    return True


def _loop(consumer: Consumer, opts: ConsumeOptions, shards: ShardHandles, starts: dict[int, tuple[int, set[int]]],
          rng: random.Random) -> Iterator[TrainingSample]:
    origin = {p: start for p, (start, _) in starts.items()}
    first = dict(origin)  # the first offset the next sample of each partition accounts for
    skip = {p: consumed for p, (_, consumed) in starts.items()}
    seen = RecentKeys(opts.dedupe_window)
    buffer: list[_Pending] = []
    layout: LayerLayout | None = None
    read = dict(origin)
    caught_up = (lambda: _caught_up(consumer, opts.topic, read)) if opts.until_end else None
    for message in records_until_idle(consumer, ConsumerErrors("trainer"), opts.poll_timeout, opts.idle_timeout,
                                      caught_up):
        p, offset = message.partition(), message.offset()
        read[p] = offset + 1
        if offset in skip[p]:  # consumed before the restart
            skip[p].discard(offset)
            continue
        event = ready_event(message)
        if not seen.add(event.event_id):  # the sink re-announced a sample (a replay): train on it once
            continue
        if held_out(event.request_id, opts.holdout):  # the gate's, to judge drafts on
            continue
        check_trainable(event)
        layout = layout or choose_layers(event.layer_ids, opts.layers)
        mask = loss_mask(shards.get(event.shard), event, opts.policy)  # a missing shard fails here, at once
        if not bool(mask.any()):
            continue  # no supervised token: dropped as the export drops it
        pending = _Pending(event, Position(p, origin[p], first[p], offset), mask)
        first[p] = offset + 1
        if opts.shuffle_buffer <= 1:
            yield _resolve(shards, pending, layout, opts.policy)
            continue
        buffer.append(pending)
        if len(buffer) >= opts.shuffle_buffer:
            i = rng.randrange(len(buffer))
            buffer[i], buffer[-1] = buffer[-1], buffer[i]
            yield _resolve(shards, buffer.pop(), layout, opts.policy)
    rng.shuffle(buffer)
    for pending in buffer:
        assert layout is not None  # set by the first sample buffered
        yield _resolve(shards, pending, layout, opts.policy)


def _resolve(shards: ShardHandles, pending: _Pending, layout: LayerLayout, policy: LossMaskPolicy) -> TrainingSample:
    sample = read_sample(shards.get(pending.event.shard), pending.event, layout, policy, mask=pending.mask)
    sample.position = pending.position
    return sample
