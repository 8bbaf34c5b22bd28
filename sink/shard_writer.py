"""Closing a partition's open shard: write it durably (shard, then index), then
announce its samples on ``hidden_states.ready``; the samples' records are done
(committable) once Kafka has every event. Used by the sink's loop, in it."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable

from hsx.dataset.shards import write_shard
from hsx.dataset.storage import Storage, StorageRefused
from hsx.runtime.kafka import DeliveryFailed
from hsx.schemas import HiddenStatesReady
from hsx.sink.partition import PartitionState
from hsx.sink.ready import ReadyPublisher
from hsx.sink.stats import SinkStats

log = logging.getLogger(__name__)


class ShardWriter:
    """Writes shards and publishes their ready events. ``fail`` stops the
    service (refused storage, undelivered events); ``done`` marks a partition's
    offsets done."""

    def __init__(self, storage: Storage, dataset: str, ready: ReadyPublisher, stats: SinkStats,
                 fail: Callable[[BaseException], None], done: Callable[[PartitionState, list[int]], None]) -> None:
        self._storage = storage
        self._dataset = dataset
        self._ready = ready
        self._stats = stats
        self._fail = fail
        self._done = done

    def close(self, state: PartitionState) -> None:
        """Write ``state``'s open shard, its index and its ready events. On a
        storage error keep everything (nothing is committed) and retry later with
        backoff."""
        shard = state.shard
        if not shard.samples:
            return
        try:
            events = write_shard(self._storage, self._dataset, shard)
        except StorageRefused as exc:  # keys revoked, bucket gone: retrying cannot help
            self._fail(exc)
            return
        except OSError as exc:
            log.error("cannot write shard %s (retrying in %.1fs): %s", shard.stem, state.write_failed(), exc)
            return
        self._publish(state, events, [o for sample in shard.samples for o in sample.offsets])
        self._stats.shard_written(shard.samples)
        state.written()
        log.info("wrote %s (%d samples)", shard.stem, len(events))

    def republish(self, states: Iterable[PartitionState]) -> None:
        """Announce again the stored samples whose duplicates arrived (their events
        may never have reached Kafka)."""
        for state in states:
            if state.republish:
                pending, state.republish = state.republish, []
                self._publish(state, [e for e, _ in pending], [o for _, offsets in pending for o in offsets])

    def _publish(self, state: PartitionState, events: list[HiddenStatesReady], offsets: list[int]) -> None:
        """Announce stored samples; their records are done once Kafka has every
        event. Undelivered events are fatal: the sink stops and commits nothing
        more; its restart finds the samples stored and announces them again."""
        try:
            self._ready.publish(events, lambda: self._done(state, offsets))
        except DeliveryFailed as exc:
            self._fail(exc)
            return
        self._stats.add("ready_events", len(events))
