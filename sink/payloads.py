"""Samples by reference (``hsx extract --payload-store``): the manifest on
``hidden_states.blocks`` names a staged object that holds its blocks. The sink
reads them from the one payload store it was given (``hsx sink
--payload-store``), and deletes each staged object once its manifest's offset is
committed: the sample is durable in the dataset by then (or was a duplicate of
one that is), so no uncommitted manifest still needs it.

Per by-reference manifest, in the sink's loop:

1. the key must be the one the manifest's request and attempt derive
   (:func:`hsx.schemas.staged_key`), else ``payload_forbidden``: a forged manifest
   cannot make the sink read any other object or file;
2. the blocks' byte ranges are read (on S3, concurrent ranged GETs); a missing
   object is ``payload_missing``, a short one ``payload_corrupt``; storage that
   does not answer raises ``OSError``: the caller keeps the manifest, commits
   nothing past it and tries again after a backoff;
3. the assembler verifies every block as it would block records;
4. once the sample is stored or dropped as a duplicate, its key waits for the
   commit of the manifest's offset (:class:`StagedObjects`), then is deleted.
   Dead-lettered objects are kept for inspection; the sweep removes them later.

The sweep deletes staged objects older than ``--staged-max-age``: those no
manifest names (an extractor killed between upload and manifest, a failed
attempt), and dead letters' once inspected. It must exceed how long a manifest can
wait uncommitted (the blocks topic's retention): an older object is deleted
even if a manifest still names it.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Callable

from hsx.dataset.sample import Sample
from hsx.dataset.storage import Storage
from hsx.runtime.errors import ServiceFailed
from hsx.runtime.kafka.watermarks import TopicPartitionKey, Watermarks
from hsx.schemas import ErrorClass, staged_key
from hsx.schemas.blocks import STAGED_SUFFIX
from hsx.sink.assembler import Assembler, RejectedRecords, Staged
from hsx.sink.partition import PartitionState

log = logging.getLogger(__name__)


class NoPayloadStore(ServiceFailed):
    """A by-reference manifest reached a sink started without ``--payload-store``."""


class PayloadReader:
    """Reads by-reference samples' blocks from the payload store. ``fail`` stops
    the service (the sink was given no payload store)."""

    def __init__(self, storage: Storage | None, fail: Callable[[BaseException], None]) -> None:
        self._storage = storage
        self._fail = fail

    def accept(self, state: PartitionState, staged: Staged) -> list[Sample | RejectedRecords]:
        """The sample of a by-reference manifest, or why it cannot be one; none
        while the store does not answer (the manifest waits in ``state.unfetched``)."""
        if state.unfetched:  # the store is away: keep the order, do not knock again before the backoff
            state.unfetched.append(staged)
            return []
        return self._fetch_all(state, [staged])

    def retry(self, state: PartitionState, now: float) -> list[Sample | RejectedRecords]:
        """The manifests kept for later, once the partition's backoff ran out."""
        if not state.unfetched or not state.fetch_backoff.ready(now):
            return []
        waiting, state.unfetched = state.unfetched, []
        return self._fetch_all(state, waiting)

    def location(self, key: str) -> str:
        return f"{self._storage.url.rstrip('/')}/{key}" if self._storage is not None else key

    def _fetch_all(self, state: PartitionState, waiting: list[Staged]) -> list[Sample | RejectedRecords]:
        done: list[Sample | RejectedRecords] = []
        for index, staged in enumerate(waiting):
            try:
                done.append(self.fetch(staged, state.assembler))
            except NoPayloadStore as exc:  # a restart with a store redoes it: nothing of it is committed
                self._fail(exc)
                return done
            except OSError as exc:
                state.unfetched = waiting[index:]
                key = staged.manifest.payload.key if staged.manifest.payload else ""
                log.error("cannot read staged object %s (retrying in %.1fs): %s", self.location(key),
                          state.fetch_backoff.failed(), exc)
                return done
        state.fetch_backoff.reset()
        return done

    def fetch(self, staged: Staged, assembler: Assembler) -> Sample | RejectedRecords:
        """The sample, or why it cannot be one. Raises ``OSError`` when the store
        does not answer (retry later) and :class:`NoPayloadStore`."""
        manifest, payload = staged.manifest, staged.manifest.payload
        assert payload is not None
        if self._storage is None:
            raise NoPayloadStore(
                f"{manifest.request_id}'s manifest (offset {staged.offset}) keeps its blocks in a payload store, and "
                f"this sink was started without one: start it with the extractor's --payload-store")
        expected = staged_key(manifest.request_id, manifest.attempt_id)
        if payload.key != expected:
            return staged.reject(ErrorClass.PAYLOAD_FORBIDDEN, f"the manifest names {payload.key!r}; "
                                 f"its attempt's staged object can only be {expected!r}")
        location = self.location(payload.key)
        try:  # the blocks tile the object (the manifest's schema checks it): one read, one buffer
            (whole,) = self._storage.read_ranges(payload.key, [(0, payload.nbytes)])
        except FileNotFoundError:
            return staged.reject(ErrorClass.PAYLOAD_MISSING, f"staged object {location} does not exist")
        if len(whole) != payload.nbytes:  # a range past the end comes back cut
            return staged.reject(ErrorClass.PAYLOAD_CORRUPT, f"staged object {location} is shorter than its "
                                 f"manifest says ({len(whole)} of {payload.nbytes} bytes)")
        return assembler.complete(staged, whole, location)


class StagedObjects:
    """Staged objects to delete once their manifests' offsets are committed, and
    the sweep of those older than ``max_age`` seconds."""

    def __init__(self, storage: Storage | None, max_age: float) -> None:
        self._storage = storage
        self._max_age = max_age
        self._next_sweep = 0.0
        self._waiting: dict[TopicPartitionKey, list[tuple[int, str]]] = defaultdict(list)

    def add(self, tp: TopicPartitionKey, sample: Sample) -> None:
        """``sample`` is stored or dropped as a duplicate: its staged object, if
        it came by reference, goes once its manifest is committed."""
        if sample.manifest.payload is not None:
            self._waiting[tp].append((sample.manifest_offset, sample.manifest.payload.key))

    def delete_committed(self, marks: Watermarks) -> None:
        """Delete the objects whose manifests are committed now. A failed delete
        is logged and left to the sweep: the sample is safe either way."""
        assert self._storage is not None or not self._waiting
        for tp, waiting in list(self._waiting.items()):
            committed = marks.committed_position(tp)
            if committed is None:
                if tp not in marks:  # revoked (its last commit came first) or lost: the next owner's now
                    del self._waiting[tp]
                continue
            done = [key for offset, key in waiting if offset < committed]
            waiting[:] = [(offset, key) for offset, key in waiting if offset >= committed]
            try:
                self._storage.delete_many(done)  # type: ignore[union-attr]
            except OSError as exc:
                log.warning("cannot delete %d staged object(s) (the sweep will): %s", len(done), exc)

    def sweep(self, now: float) -> None:
        """Every ``max_age / 4`` (at most hourly, at least a minute apart), delete
        the staged objects older than ``max_age``."""
        if self._storage is None or now < self._next_sweep:
            return
        self._next_sweep = now + max(60.0, min(3600.0, self._max_age / 4))
        try:
            stale = self._storage.stale(STAGED_SUFFIX, self._max_age)
            self._storage.delete_many(stale)
        except OSError as exc:
            log.warning("sweeping staged objects failed (next sweep later): %s", exc)
            return
        if stale:
            log.info("swept %d staged object(s) older than %.0fs", len(stale), self._max_age)
