"""Copying a :class:`~hsx.dataset.sample.FileRange` (a verified staged object
left in its file) into a shard being written: straight into the buffer a local
shard is written from, else through this process in chunks."""

from __future__ import annotations

import errno
import os

from hsx.dataset.sample import FileRange
from hsx.dataset.storage import Writer
from hsx.dataset.storage.direct_file import DirectFile

_COPY_CHUNK = 8 << 20


def copy_range(source: FileRange, out: Writer) -> None:
    """Append ``source``'s bytes to ``out``. A local shard
    (:class:`~hsx.dataset.storage.direct_file.DirectFile`) reads them straight
    into the buffer it writes from; any other writer gets them in chunks.
    ``OSError`` if the file holds fewer bytes than ``source`` says (it changed
    since it was verified)."""
    with open(source.path, "rb") as src:
        if isinstance(out, DirectFile):
            done = out.fill_from(src.fileno(), source.offset, source.length)
        else:
            done = 0
            while done < source.length:
                chunk = os.pread(src.fileno(), min(_COPY_CHUNK, source.length - done), source.offset + done)
                if not chunk:
                    break
                out.write(chunk)
                done += len(chunk)
    if done != source.length:
        raise OSError(errno.EIO, f"{source.path} holds {done} of the {source.length} bytes from offset "
                                 f"{source.offset} that were verified in it")
