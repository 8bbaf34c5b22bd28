"""Worker side of the connector's file contract: one safetensors file per request,
exactly as vLLM's ``ExampleHiddenStatesConnector`` writes it, so that vLLM's own
``load_hidden_states`` and speculators' ``hs_connectors.FileTransfer`` read it
unchanged: ``hidden_states`` ``[T, L, H]`` (layers in the order vLLM stores them,
the model's dtype) and ``token_ids`` ``[T]`` (int64).

The protocol for one request, on tensor-parallel rank 0 only:

1. In the step that first schedules the request, :meth:`FileWriter.hold` creates
   ``<path>.lock`` and takes ``LOCK_EX`` on it. That step ends before the request
   can finish, so the lock exists, held, before any response naming ``path``
   leaves the server.
2. When the request finishes, :meth:`FileWriter.write` hands its gathered rows to
   a writer thread, which waits until they are on the host (the request's cache
   blocks may go back to vLLM from then on: :meth:`FileWriter.take_copied`),
   saves them under a temporary name beside ``path``, renames that to ``path``,
   and only then closes the lock's file descriptor, which releases the lock. A
   reader that waits on the lock (vLLM: ``LOCK_SH``; speculators: ``LOCK_EX``,
   then it deletes the lock file) sees the whole file; no reader ever sees a
   partial file under the final name.
3. A request that finishes without a file (aborted), or whose write fails (a
   full disk), gets :meth:`FileWriter.drop`: its lock file is removed and then
   released, so a waiting reader finds no file rather than a partial one. A failed
   write is counted and logged with its reason; the engine goes on. A server
   killed between a response and its write leaves the lock file alone; the next
   server on the directory counts, logs and removes it (:func:`orphaned`).

Memory: rows gathered but not yet written are bounded by
``max_pending_file_bytes``; past it the connector leaves finished requests in
vLLM's cache (their blocks pinned), as the Kafka side does with its budget.

Disk: a sweeper thread (:class:`~hsx.extractor.connector.file_sweeper.FileSweeper`) follows the files on disk (this
server's, and those it found under the root at start): it deletes those older
than ``files_ttl_s`` that no reader deleted, and keeps their total under
``files_max_bytes``, which a write would pass only by being refused.
"""

from __future__ import annotations

import fcntl
import logging
import os
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from hsx.extractor.connector.file_sweeper import LOCK_SUFFIX, FileSweeper, is_held, unlink_unheld_lock
from hsx.extractor.connector.gather import Gathered
from hsx.schemas.connector import FilesConfig
from hsx.schemas.reports import FileReport

log = logging.getLogger(__name__)


@dataclass
class FileStats:
    """What the writer did since it started (``hsx serve`` counts the reports instead)."""

    written: int = 0
    written_bytes: int = 0
    failed: int = 0


class FileWriter:
    """Writes finished requests' hidden states as files; see the module docstring."""

    def __init__(self, config: FilesConfig, report: Callable[[FileReport], None] | None = None) -> None:
        self._config = config
        self._report = report
        self._sweeper = FileSweeper(config)
        self._pool = ThreadPoolExecutor(config.num_writer_threads, thread_name_prefix="hsx-file")
        self._lock = threading.Lock()
        self._locks: dict[str, int] = {}
        """Open lock file descriptors (``LOCK_EX`` held), by the file they guard."""
        self._copied: set[str] = set()
        self._pending_bytes = 0
        self._pending = 0
        self.stats = FileStats()
        for path in orphaned(config.shared_storage_path):
            log.error("hidden states never written to %s: the server that answered its request died first", path)
            if report is not None:
                report(FileReport(path=path, ok=False, earlier=True, error="the server that answered the request "
                                                                          "died before writing its file"))

    def hold(self, path: str) -> None:
        """Step 1: create ``<path>.lock`` and hold it exclusively until the file is
        complete (or dropped)."""
        with self._lock:
            if path in self._locks:
                return
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path + LOCK_SUFFIX, os.O_CREAT | os.O_WRONLY | os.O_TRUNC | os.O_CLOEXEC, 0o644)
        fcntl.flock(fd, fcntl.LOCK_EX)
        with self._lock:
            self._locks[path] = fd

    def has_room(self, nbytes: int) -> bool:
        """Whether ``nbytes`` more raw bytes fit ``max_pending_file_bytes`` (one
        request always fits when nothing else is pending)."""
        with self._lock:
            return self._pending == 0 or self._pending_bytes + nbytes <= self._config.max_pending_file_bytes

    def write(self, engine_request_id: str, path: str, gathered: Gathered, token_ids: list[int],
              finished_at: float = 0.0) -> None:
        """Step 2: write ``path`` on a writer thread; ``engine_request_id`` is
        reported by :meth:`take_copied` once the rows are on the host.
        ``finished_at`` (``time.time()`` of the request's end) times its lag."""
        nbytes = gathered.tensor.numel() * gathered.tensor.element_size()
        with self._lock:
            self._pending += 1
            self._pending_bytes += nbytes
        self._pool.submit(self._write, engine_request_id, path, gathered, token_ids, nbytes, finished_at)

    def drop(self, path: str) -> None:
        """Step 3: no file will come for ``path``: remove its lock file, then release it."""
        with self._lock:
            fd = self._locks.pop(path, None)
        if fd is None:
            return
        try:
            os.unlink(path + LOCK_SUFFIX)
        except FileNotFoundError:
            pass
        os.close(fd)

    def fail(self, path: str, reason: str) -> None:
        """Step 3 for a file that will not be written (its rows could not be
        gathered, or the write failed): logged, counted, reported, and its lock dropped."""
        log.error("hidden states not written to %s: %s", path, reason)
        with self._lock:
            self.stats.failed += 1
        self.drop(path)
        if self._report is not None:
            self._report(FileReport(path=path, ok=False, error=reason))

    def take_copied(self) -> set[str]:
        """Engine request ids whose rows are on the host since the last call: vLLM
        may free their cache blocks."""
        with self._lock:
            copied, self._copied = self._copied, set()
        return copied

    def close(self) -> None:
        """Finish the writes already submitted, then release every lock still held."""
        self._pool.shutdown(wait=True)
        self._sweeper.close()
        for path in list(self._locks):
            self.drop(path)

    def _write(self, engine_request_id: str, path: str, gathered: Gathered, token_ids: list[int],
               nbytes: int, finished_at: float) -> None:
        try:
            rows = gathered.wait()
            with self._lock:
                self._copied.add(engine_request_id)
            if not self._sweeper.reserve(nbytes):
                raise OSError(f"files_max_bytes ({self._config.files_max_bytes:,}) reached: the files readers "
                              "have not deleted fill it")
            try:
                self._save(path, rows, token_ids)
            finally:
                self._sweeper.settle(path, nbytes)
        except Exception as exc:  # noqa: BLE001 - a failed file is counted, never an engine failure
            with self._lock:
                self._copied.add(engine_request_id)  # whatever failed, the blocks go back
            self.fail(path, f"{type(exc).__name__}: {exc}")
        else:
            with self._lock:
                fd = self._locks.pop(path, None)
                self.stats.written += 1
                self.stats.written_bytes += nbytes
            if fd is not None:
                os.close(fd)  # releases LOCK_EX: readers waiting on it load the complete file
            if self._report is not None:
                self._report(FileReport(path=path, ok=True, raw_bytes=nbytes,
                                        seconds=time.time() - finished_at if finished_at else None))
        finally:
            if gathered.release is not None:
                gathered.release()
            with self._lock:
                self._pending -= 1
                self._pending_bytes -= nbytes

    @staticmethod
    def _save(path: str, rows: torch.Tensor, token_ids: list[int]) -> None:
        """Save under a temporary name in the same directory, then rename: the
        final name only ever names a whole file."""
        final = Path(path)
        temporary = final.with_name(f".{final.name}.{uuid.uuid4().hex[:12]}.tmp")
        try:
            save_file({"hidden_states": rows, "token_ids": torch.tensor(token_ids, dtype=torch.int64)},
                      str(temporary))
            os.replace(temporary, final)
        except BaseException:
            temporary.unlink(missing_ok=True)
            raise


def orphaned(root: str) -> list[str]:
    """Files promised and never written: a lock file no one holds beside no file,
    left by a server killed between a response and its write (a reader deletes
    the lock before the file, and a live writer holds its lock). Their lock
    files are removed, and so are the temporary files of writes a kill cut off
    (those whose final name's lock no one holds)."""
    if not Path(root).is_dir():
        return []
    paths = (str(lock)[: -len(LOCK_SUFFIX)] for lock in Path(root).glob(f"*.safetensors{LOCK_SUFFIX}"))
    lost = [path for path in paths if not os.path.exists(path) and unlink_unheld_lock(path)]
    for temporary in Path(root).glob(".*.safetensors.*.tmp"):
        final = temporary.parent / temporary.name[1:].rsplit(".", 2)[0]
        if not is_held(str(final)):
            temporary.unlink(missing_ok=True)
    return lost
