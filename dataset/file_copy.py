"""Copying a :class:`~hsx.dataset.sample.FileRange` (a verified staged object
left in its file) into a shard being written: by the kernel where the shard is a
file, else through this process in chunks."""

from __future__ import annotations

import errno
import os

from hsx.dataset.sample import FileRange
from hsx.dataset.storage import Writer

_COPY_CHUNK = 8 << 20
_NO_KERNEL_COPY = (errno.EXDEV, errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.EBADF)


def copy_range(source: FileRange, out: Writer) -> None:
    """Append ``source``'s bytes to ``out``. Into a file, the kernel copies them
    (``copy_file_range``: no pass through this process; a reflink where the file
    system shares blocks), else they are read in chunks and written. ``OSError``
    if the file holds fewer bytes than ``source`` says (it changed since it was
    verified)."""
    with open(source.path, "rb") as src:
        dst = _fileno(out)
        done = 0 if dst is None else _kernel_copy(src.fileno(), dst, source, out)
        while done < source.length:
            chunk = os.pread(src.fileno(), min(_COPY_CHUNK, source.length - done), source.offset + done)
            if not chunk:
                break
            out.write(chunk)
            done += len(chunk)
    if done != source.length:
        raise OSError(errno.EIO, f"{source.path} holds {done} of the {source.length} bytes from offset "
                                 f"{source.offset} that were verified in it")


def _fileno(out: Writer) -> int | None:
    """The file descriptor ``out`` writes to, if it writes to a file."""
    try:
        return int(out.fileno())  # type: ignore[attr-defined]
    except (AttributeError, OSError, ValueError):  # io.UnsupportedOperation is both of the last two
        return None


def _kernel_copy(src: int, dst: int, source: FileRange, out: Writer) -> int:
    """Bytes copied by ``copy_file_range`` (0 where the kernel cannot: another
    file system on an old kernel, a file system without it)."""
    out.flush()  # type: ignore[attr-defined]  # what the writer buffered goes first
    done = 0
    try:
        while done < source.length:
            copied = os.copy_file_range(src, dst, source.length - done, source.offset + done)
            if not copied:
                break
            done += copied
    except OSError as exc:
        if exc.errno not in _NO_KERNEL_COPY or done:
            raise
    out.seek(0, os.SEEK_END)  # type: ignore[attr-defined]  # the writer's position, after bytes written behind it
    return done
