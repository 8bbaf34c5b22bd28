"""Writing a large file around the page cache (``O_DIRECT``), for files this
machine will not read back soon: a dataset's shards; and reading one that was
written so (a staged object) the same way.

A buffered write copies every byte into page-cache pages the kernel allocates
for the new file, and those pages are the data path's largest cost where fresh
memory is dear (on the development virtual machines 0.3 to 13 CPU-seconds per GB
for the copy alone; ``python -m bench.direct_write`` measures it). Written with
``O_DIRECT``, the bytes go from one buffer of this process, reused for every
file, straight to the device: 0.02 CPU-seconds per GB there.

``O_DIRECT`` wants the buffer, the file offset and the length aligned to the
device's block. The writer copies what it is given into a page-aligned buffer
(:data:`CHUNK` bytes), writes each full buffer, and on :meth:`DirectFile.finish`
writes the tail padded to :data:`ALIGN` and cuts the file to its true size. A
file system that refuses ``O_DIRECT`` (at open or at the first write) is written
through the page cache instead, the same bytes either way.
"""

from __future__ import annotations

import errno
import fcntl
import mmap
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from typing_extensions import Buffer

ALIGN = 4096
"""The largest logical block size of common devices: offsets and lengths aligned
to it suit them all."""
CHUNK = 8 << 20
"""Bytes per write, and the size of each writer's buffer."""


def aligned(nbytes: int) -> int:
    """``nbytes`` rounded up to a multiple of :data:`ALIGN`."""
    return -(-nbytes // ALIGN) * ALIGN


_free: list[mmap.mmap] = []
_free_lock = threading.Lock()


def take_buffer() -> mmap.mmap:
    """A page-aligned buffer of :data:`CHUNK` bytes for a :class:`DirectFile`;
    give it back with :func:`give_back` for the next writer (one per writer at
    once; fresh pages are what this module avoids)."""
    with _free_lock:
        return _free.pop() if _free else mmap.mmap(-1, CHUNK)


def give_back(buffer: mmap.mmap) -> None:
    with _free_lock:
        _free.append(buffer)


@contextmanager
def direct_writer(fd: int) -> Iterator[DirectFile]:
    """Write the empty file open at ``fd`` around the page cache; it holds
    everything written once the block exits normally (not yet durable: fsync
    it). The caller closes ``fd``."""
    set_direct(fd, True)
    buffer = take_buffer()
    try:
        out = DirectFile(fd, buffer)
        yield out
        out.finish()
    finally:
        give_back(buffer)


class DirectFile:
    """The writer :func:`direct_writer` yields: ``write`` appends bytes,
    ``fill_from`` appends a range of another file read straight into the
    buffer (no copy through a buffer of the caller's)."""

    def __init__(self, fd: int, buffer: mmap.mmap, start: int = 0) -> None:
        """Write ``fd`` from ``start`` (a multiple of :data:`ALIGN`) on; what is
        before it is the caller's."""
        assert start % ALIGN == 0, start
        self._fd = fd
        self._buffer = memoryview(buffer)
        self._used = 0
        """Bytes of the buffer not yet written."""
        self._written = start
        """Bytes in the file, all whole chunks past ``start``."""

    @property
    def flushed(self) -> int:
        """The file's bytes on the device (or in the page cache, without
        ``O_DIRECT``): everything before this offset."""
        return self._written

    @property
    def size(self) -> int:
        """The file's size once :meth:`finish` ran: what is written and what waits in the buffer."""
        return self._written + self._used

    def write(self, data: Buffer) -> int:
        view = memoryview(data).cast("B")
        done = 0
        while done < len(view):
            take = min(len(view) - done, CHUNK - self._used)
            self._buffer[self._used:self._used + take] = view[done:done + take]
            self._filled(take)
            done += take
        return done

    def fill_from(self, fd: int, offset: int, length: int) -> int:
        """Append ``length`` bytes of the file ``fd`` from ``offset``; the bytes
        appended, fewer only where that file ends first. From an aligned
        ``offset`` (a staged object) the file is read around the page cache too,
        through a second buffer (this one's free part is not aligned); else
        straight into this buffer, through the cache."""
        if offset % ALIGN == 0 and set_direct(fd, True):
            return self._fill_around_cache(fd, offset, length)
        done = 0
        while done < length:
            want = min(length - done, CHUNK - self._used)
            got = os.preadv(fd, [self._buffer[self._used:self._used + want]], offset + done)
            if not got:
                break
            self._filled(got)
            done += got
        return done

    def _fill_around_cache(self, fd: int, offset: int, length: int) -> int:
        bounce = take_buffer()
        try:
            done = 0
            while done < length:
                want = min(aligned(length - done), CHUNK)
                got = read_aligned(fd, memoryview(bounce)[:want], offset + done)
                done += self.write(memoryview(bounce)[:min(got, length - done)])
                if got < want:
                    break  # the file ended
            return done
        finally:
            give_back(bounce)

    def finish(self) -> None:
        """Write the tail, padded to :data:`ALIGN`, and cut the file to its size."""
        size = self.size
        if self._used:
            padded = aligned(self._used)
            self._buffer[self._used:padded] = bytes(padded - self._used)
            self._used = padded
            self._flush()
        if self._written != size:
            os.ftruncate(self._fd, size)
            self._written = size

    def _filled(self, n: int) -> None:
        """``n`` more bytes are in the buffer: a full buffer is written at once."""
        self._used += n
        if self._used == CHUNK:
            self._flush()

    def overwrite(self, offset: int, data: Buffer) -> None:
        """After :meth:`finish`: write ``data`` over the file from ``offset``,
        both multiples of :data:`ALIGN` (a header written last, over the room
        kept for it)."""
        view = memoryview(data).cast("B")
        assert offset % ALIGN == 0 and len(view) % ALIGN == 0 and not self._used, (offset, len(view))
        for begin in range(0, len(view), CHUNK):
            piece = view[begin:begin + CHUNK]
            self._buffer[:len(piece)] = piece
            self._pwrite(self._buffer[:len(piece)], offset + begin)

    def _flush(self) -> None:
        """Write the buffer's ``_used`` bytes at the file's end."""
        self._pwrite(self._buffer[:self._used], self._written)
        self._written += self._used
        self._used = 0

    def _pwrite(self, data: memoryview, offset: int) -> None:
        """All of ``data`` at ``offset``; through the page cache from here on if
        the file system refuses ``O_DIRECT``."""
        done = 0
        while done < len(data):
            try:
                done += os.pwrite(self._fd, data[done:], offset + done)
            except OSError as exc:
                if exc.errno != errno.EINVAL or not set_direct(self._fd, False):
                    raise


@contextmanager
def open_uncached(path: Path) -> Iterator[int]:
    """``path`` open for reading around the page cache (``O_DIRECT``) where its
    file system allows it, else through the cache; read it with
    :func:`read_aligned`."""
    fd = os.open(path, os.O_RDONLY)
    try:
        set_direct(fd, True)
        yield fd
    finally:
        os.close(fd)


def read_aligned(fd: int, into: memoryview, offset: int) -> int:
    """Read ``fd`` from ``offset`` into ``into`` (page-aligned; its length and
    ``offset`` multiples of :data:`ALIGN`, as ``O_DIRECT`` wants them); the
    bytes read, fewer only where the file ends. Through the page cache from here
    on if the file system refuses ``O_DIRECT`` at the read."""
    done = 0
    while done < len(into):
        try:
            got = os.preadv(fd, [into[done:]], offset + done)
        except OSError as exc:
            if exc.errno != errno.EINVAL or not set_direct(fd, False):
                raise
            continue
        if not got:
            break
        done += got
    return done


def set_direct(fd: int, direct: bool) -> bool:
    """Set or clear ``O_DIRECT`` on ``fd``; False if that changed nothing (already
    so, or a file system that refuses it)."""
    flags = fcntl.fcntl(fd, fcntl.F_GETFL)
    wanted = flags | os.O_DIRECT if direct else flags & ~os.O_DIRECT
    if wanted == flags:
        return False
    try:
        fcntl.fcntl(fd, fcntl.F_SETFL, wanted)
    except OSError as exc:
        if exc.errno != errno.EINVAL:
            raise
        return False
    return True
