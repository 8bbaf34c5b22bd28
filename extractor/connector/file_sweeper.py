"""The files of the connector's file contract on disk, under one root: their
total bytes (for ``files_max_bytes``) and their age (for ``files_ttl_s``), kept
by a thread of their own (:class:`FileSweeper`), and the one safe way to remove
a lock file (:func:`unlink_unheld_lock`: never one a writer or reader holds)."""

from __future__ import annotations

import fcntl
import logging
import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

from hsx.schemas.connector import FilesConfig

log = logging.getLogger(__name__)

LOCK_SUFFIX = ".lock"


SWEEP_SECONDS = 5.0
"""How often the sweeper looks at the files on disk."""


class FileSweeper:
    """The files on disk under one root: their total bytes (for
    ``files_max_bytes``) and their age (for ``files_ttl_s``). A file a reader
    deleted leaves the count at the next sweep."""

    def __init__(self, config: FilesConfig) -> None:
        self._config = config
        self._lock = threading.Lock()
        self._files: dict[str, tuple[int, float]] = {}
        """Path -> (bytes, when written) of every file thought to be on disk."""
        self._bytes = 0
        """Of ``_files``, plus the writes reserved and not yet settled."""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if config.files_ttl_s is None and config.files_max_bytes is None:
            return
        for entry in Path(config.shared_storage_path).glob("*.safetensors") if Path(
                config.shared_storage_path).is_dir() else ():
            with suppress(OSError):
                stat = entry.stat()
                self._files[str(entry)] = (stat.st_size, stat.st_mtime)
                self._bytes += stat.st_size
        self._thread = threading.Thread(target=self._run, name="hsx-file-sweeper", daemon=True)
        self._thread.start()

    def reserve(self, nbytes: int) -> bool:
        """Room for a file of about ``nbytes``: counted until :meth:`settle`;
        ``False`` when it would pass ``files_max_bytes``."""
        with self._lock:
            limit = self._config.files_max_bytes
            if limit is not None and self._bytes + nbytes > limit:
                return False
            self._bytes += nbytes
            return True

    def settle(self, path: str, reserved: int) -> None:
        """The write of ``path`` ended (a file there, or none): count what is on disk."""
        try:
            size = os.stat(path).st_size
        except OSError:
            size = None
        with self._lock:
            self._bytes -= reserved
            if size is not None and self._thread is not None:
                self._files[path] = (size, time.time())
                self._bytes += size

    @property
    def bytes(self) -> int:
        with self._lock:
            return self._bytes

    def sweep(self, now: float | None = None) -> None:
        """Forget files readers deleted; delete those past ``files_ttl_s``."""
        now = time.time() if now is None else now
        ttl = self._config.files_ttl_s
        with self._lock:
            files = list(self._files.items())
        gone = []
        for path, (_size, written) in files:
            if ttl is not None and now - written > ttl:
                with suppress(FileNotFoundError):
                    os.unlink(path)
                unlink_unheld_lock(path)
                gone.append(path)
            elif not os.path.exists(path):
                gone.append(path)
        with self._lock:
            for path in gone:
                size, _ = self._files.pop(path, (0, 0.0))
                self._bytes -= size

    def _run(self) -> None:
        while not self._stop.wait(SWEEP_SECONDS):
            try:
                self.sweep()
            except Exception:  # noqa: BLE001 - the sweeper must outlive one bad file
                log.exception("sweeping %s failed", self._config.shared_storage_path)

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)


def is_held(path: str) -> bool:
    """Whether someone holds ``<path>.lock`` exclusively now (a writer mid-write)."""
    with _probed(path, fcntl.LOCK_SH) as got:
        return got is False


def unlink_unheld_lock(path: str) -> bool:
    """Remove ``<path>.lock`` unless someone holds it (a writer mid-write, a
    reader mid-read); whether it was removed here."""
    with _probed(path, fcntl.LOCK_EX) as got:
        if got:
            with suppress(FileNotFoundError):
                os.unlink(path + LOCK_SUFFIX)
                return True
        return False


@contextmanager
def _probed(path: str, operation: int) -> Iterator[bool | None]:
    """``<path>.lock`` opened and ``flock``ed with ``operation`` without waiting:
    ``True`` (taken here, until the block ends), ``False`` (someone holds it) or
    ``None`` (no lock file)."""
    try:
        fd = os.open(path + LOCK_SUFFIX, os.O_RDWR)
    except FileNotFoundError:
        yield None
        return
    try:
        try:
            fcntl.flock(fd, operation | fcntl.LOCK_NB)
        except BlockingIOError:
            yield False
        else:
            yield True
    finally:
        os.close(fd)
