"""The trainer side: read a dataset written by ``hsx sink``.

    from hsx.dataset.reader import open_dataset
    ds = open_dataset("out/")
    sample = ds["chat-42"]          # dict: request_id, token_ids, hidden_states [T, L, H], loss_mask, metadata
    for sample in ds: ...            # in index order

    for sample in follow("kafka:9092", "out/"): ...   # online, as ready events arrive

Local shards are memory-mapped (safetensors ``safe_open``); a sample costs only
the pages it touches. A dataset in an object store (``open_dataset("s3://bucket/prefix")``,
configured by the ``AWS_*`` environment, see :mod:`hsx.dataset.storage.s3`) is read with
ranged reads: a shard's header once, then only each sample's tensors; reading in
index order fetches up to 64 MiB of a shard per round of parallel requests. Samples a sink stored with a ``--dataset-codec`` other than raw
are decoded as they are read (``hsx.dataset.encoding``). PyTorch loaders, batches for speculators and the online
loader over ``hidden_states.ready`` are in ``trainer/``, built on this module.
"""

from __future__ import annotations

import os
import time
import uuid
from collections import OrderedDict
from collections.abc import Iterator
from itertools import groupby
from pathlib import Path
from typing import Any

from confluent_kafka import Consumer

from hsx.dataset.encoding import read_hidden_states, read_loss_mask, read_token_ids
from hsx.dataset.shard_reader import RemoteShard, open_shard, prefetch
from hsx.dataset.index import MissingShard, read_indexes
from hsx.dataset.storage import Storage, open_storage
from hsx.runtime.kafka import ConsumerErrors, consumer_config
from hsx.runtime.kafka.config import SEES_NEW_TOPICS
from hsx.runtime.recent import RecentKeys
from hsx.runtime.settings import KafkaSettings
from hsx.schemas import HiddenStatesReady, sample_id
from hsx.schemas.topics import READY

READ_AHEAD_BYTES = 64 << 20
"""How much of a remote shard one round of requests fetches when reading in order."""


class ShardHandles:
    """Open shards (local ones memory-mapped by ``safe_open``, remote ones a
    :class:`~hsx.dataset.shard_reader.RemoteShard` holding the header), the last ``max_open`` kept.
    Handles are never shared across processes: a pickled copy (a spawned
    DataLoader worker's) starts with none open, and so does a forked one at its
    first read, so each worker maps the files itself."""

    def __init__(self, storage: Storage, max_open: int = 16) -> None:
        self.storage = storage
        self._max_open = max_open
        self._open: OrderedDict[str, Any] = OrderedDict()
        self._pid = os.getpid()

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_open": OrderedDict()}

    def get(self, relative: str) -> Any:
        """The open shard at ``relative`` (a ready event's ``shard``); raises
        :class:`MissingShard` when the file is not there."""
        if self._pid != os.getpid():  # forked: the parent's handles stay the parent's
            self._open, self._pid = OrderedDict(), os.getpid()
        if relative in self._open:
            self._open.move_to_end(relative)
            return self._open[relative]
        try:
            handle = open_shard(self.storage, relative)
        except FileNotFoundError:
            raise MissingShard(f"shard {relative} is not in the dataset at {self.storage.url} "
                               "(is that the sink's --output, and complete?)") from None
        self._open[relative] = handle
        if len(self._open) > self._max_open:
            self._open.popitem(last=False)
        return handle


class Dataset:
    """A read-only view of a dataset, as of when it was opened."""

    def __init__(self, storage: Storage, max_open_shards: int = 16) -> None:
        self.storage = storage
        self._events: dict[str, HiddenStatesReady] = {}
        for index in read_indexes(storage):
            for event in index.events:
                # The sink writes each request id once; keep the first if a
                # hand-made directory ever disagrees.
                self._events.setdefault(event.request_id, event)
        self.shards = ShardHandles(storage, max_open_shards)

    def __len__(self) -> int:
        return len(self._events)

    def __contains__(self, request_id: object) -> bool:
        return isinstance(request_id, str) and sample_id(request_id) in self._events

    def __iter__(self) -> Iterator[dict[str, Any]]:
        """Every sample in index order (a shard's samples together)."""
        for name, events in groupby(self._events.values(), key=lambda event: event.shard):
            shard = self.shards.get(name)
            for window in _read_ahead(shard, list(events)):
                for event in window:
                    yield _sample(shard, event)

    def request_ids(self) -> list[str]:
        return list(self._events)

    def event(self, request_id: str) -> HiddenStatesReady:
        """The ready event (shard, tensor names, shapes, model) of one sample, by
        its id or by the id its prompt had (``HumanEval/0``: :func:`sample_id`)."""
        return self._events[sample_id(request_id)]

    def __getitem__(self, request_id: str) -> dict[str, Any]:
        """One sample, by its id or by the id its prompt had."""
        event = self.event(request_id)
        return _sample(self.shards.get(event.shard), event)


def _read_ahead(shard: Any, events: list[HiddenStatesReady]) -> Iterator[list[HiddenStatesReady]]:
    """The events in windows of about :data:`READ_AHEAD_BYTES`, each window's
    tensors fetched before it is yielded (a remote shard), so that reading a
    shard in order costs a few large requests, not a few per sample."""
    if not isinstance(shard, RemoteShard):
        yield events
        return
    window: list[HiddenStatesReady] = []
    size = 0
    for i, event in enumerate(events):
        window.append(event)
        size += sum(shard.nbytes(name) for name in tensor_names(event))
        if size >= READ_AHEAD_BYTES or i == len(events) - 1:
            shard.prefetch(name for e in window for name in tensor_names(e))
            yield window
            window, size = [], 0


def tensor_names(event: HiddenStatesReady) -> list[str]:
    """The names of a sample's tensors in its shard."""
    names = event.tensors
    return [names.hidden_states, names.token_ids] + ([names.loss_mask] if names.loss_mask else [])


def _sample(shard: Any, event: HiddenStatesReady) -> dict[str, Any]:
    prefetch(shard, tensor_names(event))  # a remote sample: its tensors in one round of requests
    return {
        "request_id": event.request_id,
        "token_ids": read_token_ids(shard, event),
        "hidden_states": read_hidden_states(shard, event),
        "loss_mask": read_loss_mask(shard, event),
        "metadata": event.metadata or {},
    }


def follow(
    bootstrap: str,
    dataset: str | Path,
    topic: str = READY,
    group_id: str | None = None,
    idle_timeout: float | None = None,
    kafka: KafkaSettings | None = None,
    dedupe_window: int = 100_000,
) -> Iterator[dict[str, Any]]:
    """Yield samples as their ``hidden_states.ready`` events arrive, for training
    online while extraction runs. Each event names a shard that is already
    durable in ``dataset``. Events are de-duplicated by their deterministic
    ``event_id`` (the last ``dedupe_window`` of them, so memory stays bounded);
    the consumer group (default: a fresh one, reading from the
    start) commits automatically, so a restarted trainer resumes roughly where it
    stopped (at least once). Stops after ``idle_timeout`` seconds without events,
    if given."""
    settings = (kafka or KafkaSettings()).model_copy(update={"bootstrap": bootstrap})
    consumer = Consumer(consumer_config(
        settings, group_id or f"hsx-follow-{uuid.uuid4().hex}",
        **{"enable.auto.commit": True, "enable.auto.offset.store": True, **SEES_NEW_TOPICS}))
    assigned = False

    def on_assign(_consumer: Consumer, _partitions: list) -> None:
        nonlocal assigned, last
        assigned, last = True, time.monotonic()

    consumer.subscribe([topic], on_assign=on_assign)
    shards = ShardHandles(open_storage(dataset, create=True))  # a local one created if the sink has not yet
    seen = RecentKeys(dedupe_window)
    last = time.monotonic()
    errors = ConsumerErrors("follow")
    try:
        # Joining the group takes seconds: allow a minute more before the first assignment.
        while idle_timeout is None or time.monotonic() - last < idle_timeout + (0 if assigned else 60):
            message = consumer.poll(0.5)
            if message is None:
                continue
            if message.error() is not None:
                errors.check(message.error())  # raises KafkaFatal; transient ones are counted
                continue
            last = time.monotonic()
            event = HiddenStatesReady.model_validate_json(message.value())
            if not seen.add(event.event_id):
                continue
            yield _sample(shards.get(event.shard), event)
    finally:
        consumer.close()


def open_dataset(path: str | Path) -> Dataset:
    """Open the dataset at ``path`` (the sink's ``--output``: a directory or
    ``s3://bucket/prefix``)."""
    return Dataset(open_storage(path))
