"""Samples by reference (``hsx extract --payload-store``): the manifest on
``hidden_states.blocks`` names a staged object that holds its blocks. The sink
reads them from the one payload store it was given (``hsx sink
--payload-store``), and deletes each staged object once no manifest can need it
again: its sample is durable in the dataset, or it was a duplicate of one.

Per by-reference manifest, in the sink's loop:

1. a request the partition already holds is settled from the manifest alone
   (a duplicate, or a conflict): its blocks are never fetched, so a replay
   after a crash needs no staged object of a stored sample;
2. the key must be the one the manifest's request and attempt derive
   (:func:`hsx.schemas.staged_key`), else ``payload_forbidden``: a forged manifest
   cannot make the sink read any other object or file;
3. the staged object is read in one read; a missing object is
   ``payload_missing``, a short one ``payload_corrupt``; storage that does not
   answer raises ``OSError``: the caller keeps the manifest, commits nothing
   past it and tries again after a backoff;
4. the assembler verifies every block as it would block records. A sample
   stored as its records came (``byteplane-zstd``) from a staged object in a
   directory is read into a reused buffer to be verified, and then left in its
   file (:class:`~hsx.dataset.sample.FileRange`): its shard copies it from there
   (step 5 keeps the file until then), so the sink holds none of its bytes;
5. once the sample's shard is durable, or the sample is dropped as a duplicate
   of one that is (of one in a shard not yet written: once that shard is), its
   key waits in :class:`StagedObjects`, which deletes it at the start of the
   next commit: no manifest is committed while its object waits, so a crash
   cannot leave a stored sample's object behind (step 1 makes deleting before
   the commit safe). Dead-lettered objects are kept for inspection.

The sweep deletes staged objects older than ``--staged-max-age``: those no
manifest names (an extractor killed between upload and manifest, a failed
attempt), dead letters' once inspected, and a lost partition's (its next owner
may not know of our last shard yet). It must exceed how long a manifest can wait
uncommitted (the blocks topic's retention): an older object is deleted even if a
manifest still names it, and a shard whose sample was left in it cannot be
written (the write is retried, logged, until the sink restarts and replays).
"""

from __future__ import annotations

import logging
import mmap
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import replace
from pathlib import Path

from hsx.dataset.sample import FileRange, Sample
from hsx.dataset.storage import Storage
from hsx.dataset.storage.direct_file import ALIGN, aligned, open_uncached, read_aligned
from hsx.runtime.errors import ServiceFailed
from hsx.runtime.kafka.watermarks import TopicPartitionKey
from hsx.schemas import ErrorClass, Manifest, staged_key
from hsx.schemas.manifest import STAGED_SUFFIX
from hsx.sink.assembler import Assembler, RejectedRecords, Staged
from hsx.sink.partition import PartitionState

log = logging.getLogger(__name__)


class NoPayloadStore(ServiceFailed):
    """A by-reference manifest reached a sink started without ``--payload-store``."""


class PayloadReader:
    """Reads by-reference samples' blocks from the payload store. ``fail`` stops
    the service (the sink was given no payload store)."""

    def __init__(self, storage: Storage | None, fail: Callable[[BaseException], None],
                 buffer_max: int = 256 << 20) -> None:
        self._storage = storage
        self._fail = fail
        self._buffer = mmap.mmap(-1, ALIGN)
        """Staged objects from a directory are read into it to be verified, around
        the page cache (the connector writes them so), reused."""
        self._buffer_max = buffer_max
        """Larger objects are read as from an object store, into a buffer of their own."""

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
        path = self._storage.local_path(payload.key)
        if path is not None and assembler.keeps_records:
            kept = self._left_in_file(staged, assembler, path, payload.nbytes, location)
            if kept is not None:
                return kept
        try:  # the blocks tile the object (the manifest's schema checks it): one read, one buffer
            (whole,) = self._storage.read_ranges(payload.key, [(0, payload.nbytes)])
        except FileNotFoundError:
            return _missing(staged, location)
        if len(whole) != payload.nbytes:  # a range past the end comes back cut
            return _short(staged, location, len(whole), payload.nbytes)
        return assembler.complete(staged, whole, location)

    def _left_in_file(self, staged: Staged, assembler: Assembler, path: Path, nbytes: int,
                      location: str) -> Sample | RejectedRecords | None:
        """The sample with its bytes left in the staged file, verified from the
        reused buffer; or why it cannot be one; or None when it is not stored as
        its records came (decoded, it needs bytes of its own: read it again)."""
        if nbytes > self._buffer_max:
            return None
        padded = aligned(nbytes)
        if len(self._buffer) < padded:
            self._buffer = mmap.mmap(-1, padded)  # page-aligned, as a read around the page cache wants
        try:
            with open_uncached(path) as fd:
                got = min(read_aligned(fd, memoryview(self._buffer)[:padded], 0), nbytes)
        except FileNotFoundError:
            return _missing(staged, location)
        if got != nbytes:
            return _short(staged, location, got, nbytes)
        view = memoryview(self._buffer)[:nbytes]
        done = assembler.complete(staged, view, location)
        if isinstance(done, Sample):
            return replace(done, hidden_states=FileRange(path, 0, nbytes)) if done.hidden_states is view else None
        return done


def _missing(staged: Staged, location: str) -> RejectedRecords:
    return staged.reject(ErrorClass.PAYLOAD_MISSING, f"staged object {location} does not exist")


def _short(staged: Staged, location: str, got: int, nbytes: int) -> RejectedRecords:
    return staged.reject(ErrorClass.PAYLOAD_CORRUPT, f"staged object {location} is shorter than its manifest says "
                                                     f"({got} of {nbytes} bytes)")


class StagedObjects:
    """Staged objects no manifest needs any more, deleted before the next commit;
    and the sweep of those older than ``max_age`` seconds."""

    def __init__(self, storage: Storage | None, max_age: float) -> None:
        self._storage = storage
        self._max_age = max_age
        self._next_sweep = 0.0
        self._unneeded: dict[TopicPartitionKey, list[str]] = defaultdict(list)
        self._with_copy: dict[TopicPartitionKey, dict[str, list[str]]] = defaultdict(lambda: defaultdict(list))
        """Duplicates' keys, by the request whose first copy waits in a shard not yet written."""

    def add(self, tp: TopicPartitionKey, manifests: Iterable[Manifest]) -> None:
        """The samples of ``manifests`` are durable in the dataset, or were
        duplicates of one: a replay settles them without fetching (step 1), so
        their staged objects, for those sent by reference, can go, and so can
        the duplicates' that waited for them (a sink without a payload store
        settles by-reference duplicates, deleting nothing)."""
        if self._storage is None:
            return
        waiting = self._with_copy.get(tp, {})
        for manifest in manifests:
            if manifest.payload is not None:
                self._unneeded[tp].append(manifest.payload.key)
            self._unneeded[tp].extend(waiting.pop(manifest.request_id, ()))

    def add_with_copy(self, tp: TopicPartitionKey, manifest: Manifest) -> None:
        """``manifest`` duplicates a copy in a shard not yet written: its object goes
        with that copy's. Sooner, a crash could leave a replay that meets it first
        (an earlier by-reference attempt that waited for the store while an inline
        one was stored) with the copy not stored and the object gone."""
        if self._storage is not None and manifest.payload is not None:
            self._with_copy[tp][manifest.request_id].append(manifest.payload.key)

    def forget(self, tp: TopicPartitionKey) -> None:
        """``tp`` was lost: its next owner may have loaded the partition before our
        last shard landed, and would fetch those samples again. The sweep deletes them."""
        self._unneeded.pop(tp, None)
        self._with_copy.pop(tp, None)

    def delete(self) -> None:
        """Delete every object added. The sink calls it first in every commit. A
        failed delete is logged and left to the sweep: the samples are safe either way."""
        unneeded = [key for keys in self._unneeded.values() for key in keys]
        self._unneeded.clear()
        if not unneeded:
            return
        try:
            self._storage.delete_many(unneeded)  # type: ignore[union-attr]
        except OSError as exc:
            log.warning("cannot delete %d staged object(s) (the sweep will): %s", len(unneeded), exc)

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
