"""Writing closed shards without stopping the sink's loop: one writer thread
writes them (shard, keys, index: :func:`~hsx.dataset.shards.write_shard`), the
loop submits, reaps and announces.

Per partition, in the loop's thread:

1. ``close(state)``: the open shard joins the partition's closed shards and a new
   one opens at once, so consumption goes on while it is written.
2. The writer writes a partition's closed shards one at a time, oldest first, so
   they land in name order (:func:`~hsx.dataset.shards.remove_orphans` relies on it).
3. ``reap(states)``, each turn of the loop: a written shard's samples join the
   partition's known keys, ``written`` hears of the shard (the sink then needs
   its samples' staged objects no more) and their ready events are published; the records
   behind them are done once Kafka has every event. A failed write is submitted
   again after the partition's backoff; refused storage stops the service.
4. ``settle(state)`` on revoke and on the final flush: close, write everything
   now and wait. ``wait(state)`` when partitions are lost: only the write under
   way is finished (its shard may land; the rest is the next owner's to replay).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import wait as wait_for

from hsx.dataset.shards import OpenShard, write_shard
from hsx.dataset.storage import Storage, StorageRefused
from hsx.runtime.kafka import DeliveryFailed
from hsx.schemas import HiddenStatesReady
from hsx.sink.partition import PartitionState
from hsx.sink.ready import ReadyPublisher
from hsx.sink.stats import SinkStats

log = logging.getLogger(__name__)


class ShardWriter:
    """Writes shards in a thread of its own and publishes their ready events.
    ``fail`` stops the service (refused storage, undelivered events); ``done``
    marks a partition's offsets done; ``written`` is told of each shard in the
    dataset. Every method is called from the loop's thread."""

    def __init__(self, storage: Storage, dataset: str, ready: ReadyPublisher, stats: SinkStats,
                 fail: Callable[[BaseException], None], done: Callable[[PartitionState, list[int]], None],
                 written: Callable[[PartitionState, OpenShard], None]) -> None:
        self._storage = storage
        self._dataset = dataset
        self._ready = ready
        self._stats = stats
        self._fail = fail
        self._done = done
        self._written = written
        self._refused = False
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="shard-writer")

    def close(self, state: PartitionState) -> None:
        """Close ``state``'s open shard (if it holds samples) and write it when its turn comes."""
        if state.shard.samples:
            state.close_shard()
            self._next(state)

    def reap(self, states: Iterable[PartitionState]) -> None:
        """Announce the shards written since the last call; start the next writes."""
        for state in states:
            if state.writing is not None and state.writing.done():
                self._finish(state)
            self._next(state)

    def settle(self, state: PartitionState) -> None:
        """Close the open shard and write every closed one now, backoff or not;
        stop at the first failure (its records stay uncommitted)."""
        self.close(state)
        while state.closed and not self._refused:
            if state.writing is None:
                self._submit(state)
            if not self.wait(state):
                return

    def wait(self, state: PartitionState) -> bool:
        """Finish the write under way, if any; False if it failed."""
        if state.writing is None:
            return True
        wait_for([state.writing])
        return self._finish(state)

    def shutdown(self) -> None:
        self._thread.shutdown(wait=True)

    def republish(self, states: Iterable[PartitionState]) -> None:
        """Announce again the stored samples whose duplicates arrived (their events
        may never have reached Kafka)."""
        for state in states:
            if state.republish:
                pending, state.republish = state.republish, []
                self._publish(state, [e for e, _ in pending], [o for _, offsets in pending for o in offsets])

    def _next(self, state: PartitionState) -> None:
        if state.closed and state.writing is None and not self._refused and state.write_backoff.ready():
            self._submit(state)

    def _submit(self, state: PartitionState) -> None:
        state.writing = self._thread.submit(write_shard, self._storage, self._dataset, state.closed[0])

    def _finish(self, state: PartitionState) -> bool:
        """Take the finished write's outcome; True if the shard is in the dataset.
        On a storage error everything stays (nothing is committed) and the write
        is tried again after the backoff."""
        assert state.writing is not None
        writing, state.writing = state.writing, None
        stem = state.closed[0].stem
        try:
            events = writing.result()
        except StorageRefused as exc:  # keys revoked, bucket gone: retrying cannot help
            self._refused = True
            self._fail(exc)
            return False
        except OSError as exc:
            log.error("cannot write shard %s (retrying in %.1fs): %s", stem, state.write_backoff.failed(), exc)
            return False
        shard = state.written()
        self._written(state, shard)
        self._publish(state, events, [o for sample in shard.samples for o in sample.offsets])
        self._stats.shard_written(shard.samples)
        log.info("wrote %s (%d samples)", stem, len(events))
        return True

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
