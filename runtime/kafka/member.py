"""The consumer-group member both services are built on.

A service supplies only what is its own: what to do with a record (it calls
:meth:`GroupMember.poll` and handles what comes back), what "make the revoked
partitions' work durable" means (:class:`PartitionHandler`), and what runs on
each tick of its loop. The member owns everything else: the ``Consumer``, the
subscription and the three rebalance callbacks, the watermarks, pausing, the
commit schedule and the lag gauge, idle exit, SIGTERM/SIGINT leading to a drain,
and the health/readiness server.

The sink drives it from a plain loop; the extractor from an asyncio loop, because
it awaits vLLM and the connector's reports. Nothing here blocks for long
(``poll`` takes a timeout, 0 for the extractor), so one class serves both.
"""

from __future__ import annotations

import logging
import signal
import time
from collections.abc import Callable, Iterator
from typing import Any

from confluent_kafka import Consumer, Message, TopicPartition

from hsx.runtime.errors import ServiceFailed
from hsx.runtime.health import HealthServer
from hsx.runtime.kafka.commits import commit_watermarks, partition_lag
from hsx.runtime.kafka.config import consumer_config
from hsx.runtime.kafka.errors import ConsumerErrors, KafkaFatal
from hsx.runtime.kafka.partitions import Commit, PartitionHandler, Stateless
from hsx.runtime.kafka.stall import StallWatch
from hsx.runtime.kafka.watermarks import TopicPartitionKey, Watermarks
from hsx.runtime.metrics import member_metrics
from hsx.runtime.settings import KafkaSettings

log = logging.getLogger(__name__)

class GroupMember:
    """One member of a consumer group, with the commit discipline hsx relies on:
    an offset is committed only when :meth:`done` was called for it and every
    offset before it (see :class:`Watermarks`)."""

    def __init__(
        self,
        kafka: KafkaSettings,
        group_id: str,
        topic: str,
        service: str,
        handler: PartitionHandler | None = None,
        *,
        consumer_overrides: dict[str, Any] | None = None,
        commit_interval: float = 1.0,
        exit_when_idle: float | None = None,
        stall_timeout: float = 600.0,
    ) -> None:
        self.marks = Watermarks()
        self.stopping = False
        self.paused = False
        self.fatal: BaseException | None = None
        self.health: HealthServer | None = None
        self._kafka = kafka
        self._group_id = group_id
        self._topic = topic
        self._handler = handler or Stateless()
        self._overrides = consumer_overrides or {}
        self._commit_interval = commit_interval
        self._exit_when_idle = exit_when_idle
        self._metrics = member_metrics(service)
        self.stall = StallWatch(stall_timeout, self._metrics.seconds_since_progress,
                                lag_check_s=max(5.0, commit_interval))
        """The stall clock behind /healthz (see :class:`StallWatch`)."""
        self._errors = ConsumerErrors(service)
        self._consumer: Consumer | None = None
        self._cooperative = True
        self._assigned: set[TopicPartitionKey] = set()
        self._commit: Commit = self._commit_watermarks
        self._last_commit = time.monotonic()
        self._last_activity: float | None = None
        """When something last happened. None until the first assignment (an empty
        one too): start-up, joining the group included, is not idleness, and a join
        can take a while (Kafka waits for the group's members to rejoin; tansu holds
        a first join for half the session)."""

    # -- lifecycle ---------------------------------------------------------------------------

    def handle_signals(self, stop: Callable[[], None] | None = None) -> None:
        """SIGTERM and SIGINT start a drain: ``stop`` (default :meth:`stop`), which
        must end in :meth:`stop`."""
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: (stop or self.stop)())

    def serve_health(self, port: int | None, not_ready: Callable[[], str | None], status: Callable[[], str]) -> None:
        """Serve /healthz, /readyz and /metrics on ``port`` (0: any free port; None:
        off). ``not_ready`` names a service-specific reason to fail readiness (or
        None); ``status`` is the text of a ready answer."""
        if port is None:
            return

        def readiness() -> tuple[bool, str]:
            reason = not_ready()
            if reason is None:
                reason = self._not_ready()
            return (False, reason) if reason else (True, f"ready: {status()}")

        self.health = HealthServer(port, readiness, self.stall.liveness).start()

    def subscribe(self, commit: Commit | None = None) -> None:
        """Create the consumer and join the group. ``commit`` replaces the plain
        offset commit (the sink's transactional mode commits inside a transaction)."""
        if commit is not None:
            self._commit = commit
        config = consumer_config(self._kafka, self._group_id, **self._overrides)
        self._cooperative = "cooperative" in str(config.get("partition.assignment.strategy", ""))
        self._consumer = Consumer(config)
        self._consumer.subscribe([self._topic], on_assign=self._on_assign, on_revoke=self._on_revoke,
                                 on_lost=self._on_lost)
        self._last_commit = time.monotonic()

    def stop(self) -> None:
        """Stop fetching; the service finishes its work, commits and leaves."""
        if not self.stopping:
            log.info("stopping: draining")
        self.stopping = True

    def fail(self, error: BaseException) -> None:
        """Stop at once: the service cannot go on safely. It still commits what is
        finished, never past the failure; a restart reprocesses the rest."""
        if self.fatal is None:
            self.fatal = error
            log.error("fatal: %s", error)
        self.stopping = True

    def raise_if_failed(self) -> None:
        """After the drain: raise :class:`ServiceFailed` if :meth:`fail` was called."""
        if self.fatal is not None:
            raise ServiceFailed(str(self.fatal)) from self.fatal

    def close(self) -> None:
        """Leave the group (partitions move on at once) and stop the health server."""
        if self._consumer is not None:
            self._consumer.close()
        if self.health is not None:
            self.health.stop()

    @property
    def assignment(self) -> frozenset[TopicPartitionKey]:
        """The partitions this member holds now (its own record, kept by the
        rebalance callbacks: safe to read from any thread)."""
        return frozenset(self._assigned)

    @property
    def consumer(self) -> Consumer:
        assert self._consumer is not None, "subscribe() first"
        return self._consumer

    # -- the loop's steps --------------------------------------------------------------------

    def poll(self, max_messages: int, timeout: float) -> Iterator[Message]:
        """Records of assigned partitions, up to ``max_messages``, each taken from
        the client as the caller asks for it and its offset tracked: a caller that
        stops early leaves the rest in the client's queue (the sink, once its
        memory budget is full; a batch taken whole would hold ``max_messages``
        records of any size). Waits for records up to ``timeout`` seconds in all.
        Consumer errors follow :class:`ConsumerErrors`: transient ones are
        counted, a fatal one fails the member (the service stops)."""
        deadline = time.monotonic() + timeout
        taken = 0
        while taken < max_messages:
            messages = self.consumer.consume(num_messages=1, timeout=max(0.0, deadline - time.monotonic()))
            if not messages:
                return
            message = messages[0]
            error = message.error()
            if error is not None:
                try:
                    self._errors.check(error)
                except KafkaFatal as exc:
                    self.fail(exc)
                continue
            key = (message.topic(), message.partition())
            if key not in self._assigned:
                continue  # revoked between fetch and delivery
            self.marks.track(key, message.offset())
            self.touch()
            self.stall.progress()
            taken += 1
            yield message

    def done(self, tp: TopicPartitionKey, offset: int) -> None:
        """Everything the record at ``offset`` caused is durable: it may be committed."""
        self.marks.done(tp, offset)
        self.stall.progress()

    def touch(self) -> None:
        """Something happened: the idle clock starts again."""
        self._last_activity = time.monotonic()

    def tick(self, busy: bool = False) -> None:
        """Commit (and update the lag gauge) when the interval is up; stop when
        idle for ``exit_when_idle`` seconds since the last activity (at the
        earliest, the first assignment) and not ``busy``."""
        now = time.monotonic()
        if now - self._last_commit >= self._commit_interval:
            self.commit()
            for (topic, partition), lag in partition_lag(self.consumer).items():
                self._metrics.lag.labels(topic, str(partition)).set(lag)
            self._last_commit = now
        self.stall.update(now, self.marks.in_flight(), self.consumer, self._assigned)
        idle = self._exit_when_idle
        if busy:
            self._last_activity = now
        elif (idle is not None and self._last_activity is not None and now - self._last_activity >= idle
              and not self.stopping):
            log.info("idle for %.0fs: stopping", idle)
            self.stopping = True

    def pause(self, paused: bool) -> None:
        """Pause (or resume) every assigned partition; partitions assigned while
        paused start paused."""
        if paused != self.paused:
            (self.consumer.pause if paused else self.consumer.resume)(self.consumer.assignment())
            self.paused = paused

    def commit(self, only: set[TopicPartitionKey] | None = None) -> None:
        with self._metrics.commit_seconds.time():
            self._commit(only)

    def _commit_watermarks(self, only: set[TopicPartitionKey] | None) -> None:
        commit_watermarks(self.consumer, self.marks, only)

    def _not_ready(self) -> str | None:
        if self._consumer is None:
            return "joining the consumer group"
        if self.stopping:
            return "draining"
        # The member's own record of its assignment: the health server's thread must
        # not call into the consumer, whose calls can wait behind the loop's poll.
        if not self._assigned:
            return "no partitions assigned"
        return None

    # -- rebalance callbacks (librdkafka calls them from inside poll) ------------------------

    def _on_assign(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        """1. the service sets up the partitions' state; 2. the partitions are
        assigned here rather than after the callback, so that 3. they take the
        member's pause state, explicitly either way. librdkafka keeps a
        partition's pause flag across a loss and re-assignment: a partition lost
        while paused would come back paused after the member resumed (while it
        held nothing) and never be fetched again. And a pause before the
        assignment does not hold for a partition the consumer never had."""
        keys = self._rebalanced("assign", partitions)
        self._handler.assigned(keys)
        self._assigned.update(keys)
        self.touch()
        (consumer.incremental_assign if self._cooperative else consumer.assign)(partitions)
        (consumer.pause if self.paused else consumer.resume)(partitions)

    def _on_revoke(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        """1. the service makes the revoked partitions' work durable; 2. what is
        finished of them is committed, never past unfinished work (records still
        running are reprocessed by the next owner; the sink drops the duplicates);
        3. their watermarks are forgotten, so late completions are ignored."""
        keys = self._rebalanced("revoke", partitions)
        self._handler.revoked(keys)
        self.commit(only=set(keys))
        self._forget(keys)

    def _on_lost(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        """The session expired (e.g. the broker was away longer than the session
        timeout): another member may own the partitions already, so nothing is
        committed; their records are reprocessed and the sink drops duplicates."""
        keys = self._rebalanced("lost", partitions)
        log.warning("lost %s without a chance to commit", keys)
        self._handler.lost(keys)
        self._forget(keys)

    def _rebalanced(self, kind: str, partitions: list[TopicPartition]) -> list[TopicPartitionKey]:
        keys = [(p.topic, p.partition) for p in partitions]
        if kind != "lost":
            log.info("%s %s", "assigned" if kind == "assign" else "revoked", keys)
        self._metrics.rebalances.labels(kind).inc()
        return keys

    def _forget(self, keys: list[TopicPartitionKey]) -> None:
        for key in keys:
            self._assigned.discard(key)
            self.marks.forget(key)
