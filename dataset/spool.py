"""An open shard streamed to its file as its samples join (local datasets), so
the sink holds one buffer per open shard rather than the shard.

A streamed shard is a safetensors file laid out for being written front to back
without knowing its header until it closes (safetensors allows a header padded
with spaces)::

    [0, 8)             the header's length
    [8, data start)    the header, padded with spaces
    [data start, room) every sample's token ids (I64), ending exactly at ``room``
    [room, end)        every sample's stored hidden states, appended as it joins
    [end, size)        the loss masks (BOOL)

``room`` is fixed when the spool starts (:func:`room_for`); the shard closes
before its header and token ids would outgrow it (``OpenShard.accepts``).

The protocol, in order:

1. :meth:`ShardSpool.start`: a temp file beside the shard, named as
   ``LocalStorage.open_atomic`` names its own, written from ``room`` on around the
   page cache (:mod:`~hsx.dataset.storage.direct_file`).
2. :meth:`ShardSpool.take`, per sample: its stored bytes go to the file's end;
   a sample leaves memory once all its bytes are in the file (until then the
   buffer has the last of them).
3. :meth:`ShardSpool.landed_shard`, in the shard writer's thread: the masks
   appended, the tail written, the head written over the room, fsync, rename,
   fsync of the folder. The key file and the index follow as for any shard.
4. :meth:`ShardSpool.discard` once the shard is in the dataset or dropped.

A spool that fails (a full disk, a header that outgrew its room) is ``broken``:
nothing is lost, as a sample leaves memory only once its bytes are in the file.
The shard is then written as a held one, its streamed samples read back from
the temp file (:class:`~hsx.dataset.sample.FileRange`), which goes at step 4.
"""

from __future__ import annotations

import logging
import os
import tempfile
from collections import deque
from pathlib import Path
from typing import Any

import orjson

from hsx.dataset.encoding import stored_tensor
from hsx.dataset.safetensors_io import streamed_layout, tensor_layout, write_tensor
from hsx.dataset.sample import FileRange, Sample
from hsx.dataset.storage.direct_file import ALIGN, DirectFile, give_back, set_direct, take_buffer
from hsx.dataset.storage.local import fsync_path
from hsx.schemas import Manifest

log = logging.getLogger(__name__)

MIN_ROOM = 1 << 20
MAX_ROOM = 64 << 20


def fixed_head_bytes(metadata: dict[str, str]) -> int:
    """A bound on the header bytes a shard needs whatever its samples: length,
    braces, and ``metadata`` (its first sample's, without request ids)."""
    return 8 + 64 + len(orjson.dumps(metadata))


def head_bytes(manifest: Manifest) -> int:
    """A bound on the header and token-id bytes a sample adds to its shard:
    per tensor its name and an entry of at most 150 characters, its request id
    twice escaped in the metadata, 8 bytes per token id."""
    rid = len(orjson.dumps(manifest.request_id))
    tensors = 3 if manifest.loss_mask_spans is not None else 2
    return tensors * (rid + 150) + 2 * rid + 4 + 8 * manifest.num_tokens


def room_for(needed: int, nbytes: int, max_shard_bytes: int) -> int:
    """The room to keep for a shard's header and token ids, from what its first
    samples need (``needed`` for ``nbytes`` stored): enough for a shard of
    ``max_shard_bytes`` of such samples and a quarter more, in whole MiB."""
    wanted = needed * max_shard_bytes // max(nbytes, 1) * 5 // 4
    return min(MAX_ROOM, max(MIN_ROOM, -(-wanted // MIN_ROOM) * MIN_ROOM))


class ShardSpool:
    """The file of one streamed shard; see the module's protocol."""

    def __init__(self, target: Path, room: int) -> None:
        assert room % ALIGN == 0, room
        self.target = target
        self.room = room
        self.broken = False
        """It failed: the shard is written the held way."""
        self.landed = False
        """It is the shard (renamed), though maybe not durably yet."""
        self.placed: dict[str, FileRange] = {}
        """Where each streamed sample's bytes are, by request id."""
        self._unflushed: deque[Sample] = deque()
        """Streamed samples whose bytes are not all in the file yet: held until they are."""
        fd, name = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
        self.path = Path(name)
        try:
            set_direct(fd, True)
        except OSError:
            os.close(fd)
            self.path.unlink(missing_ok=True)
            raise
        self._fd: int | None = fd
        self._buffer = take_buffer()
        self._out = DirectFile(fd, self._buffer, start=room)

    @classmethod
    def start(cls, target: Path, room: int) -> ShardSpool:
        """Step 1: the spool of the shard that will be ``target``."""
        target.parent.mkdir(parents=True, exist_ok=True)
        return cls(target, room)

    @property
    def buffer_bytes(self) -> int:
        """The memory it holds while open (its write buffer)."""
        return 0 if self._fd is None else len(self._buffer)

    @property
    def flushed(self) -> int:
        """Bytes of the file written so far: a sample ending before this offset is in it."""
        return self._out.flushed

    def take(self, sample: Sample) -> int:
        """Step 2: append the sample's stored bytes (its checksum must be set);
        then every sample whose bytes are all in the file leaves memory (its
        bytes become their :class:`FileRange` in the file). Returns the bytes
        that left memory. ``OSError``: the spool is broken, no sample left
        memory that was not in the file."""
        stored = stored_tensor(sample)
        dtype, shape, size = tensor_layout(stored)
        at = self._out.size
        try:
            write_tensor(self._out, stored)
        except OSError:
            self.broken = True
            raise
        self.placed[sample.manifest.request_id] = FileRange(self.path, at, size, dtype, shape)
        self._unflushed.append(sample)
        released = 0
        while self._unflushed:
            first = self._unflushed[0]
            where = self.placed[first.manifest.request_id]
            if where.offset + where.length > self.flushed:
                break
            self._unflushed.popleft()
            released += first.held_bytes
            first.hidden_states = where
        return released

    def landed_shard(self, tensors: dict[str, Any], metadata: dict[str, str]) -> bool:
        """Step 3 for the shard of ``tensors`` (every sample's, as ``write_shard``
        saves them) and ``metadata``: True once its file is in place, False where
        it must be written the held way (broken, or breaking now: its streamed
        samples are then read back from here). ``OSError`` once renamed, when the
        folder's fsync failed: the retry syncs it."""
        if self.broken:
            return False
        if self.landed:  # an earlier attempt renamed it and failed after
            fsync_path(self.target.parent)
            return True
        hidden = {f"{rid}/hidden_states": (where.offset, where) for rid, where in self.placed.items()}
        front = {name: t for name, t in tensors.items() if name not in hidden and t.element_size() == 8}
        back = {name: t for name, t in tensors.items() if name not in hidden and name not in front}
        try:
            self.land(*streamed_layout(front, hidden, self.room, back, metadata))
        except OSError as exc:
            if self.landed:
                raise
            log.warning("%s: its streamed file failed (%s); writing it again from %s", self.target.name, exc, self.path)
            self.broken = True
            return False
        return True

    def land(self, head: bytes, back: list[memoryview]) -> None:
        """Write ``back`` (after the samples), then ``head`` (``room`` bytes: see
        :func:`~hsx.dataset.safetensors_io.streamed_layout`) at the start, and
        make the file the shard, durably."""
        assert self._fd is not None and len(head) == self.room
        for tensor in back:
            self._out.write(tensor)
        self._out.finish()
        self._out.overwrite(0, head)
        os.fsync(self._fd)
        os.replace(self.path, self.target)
        self.landed = True
        fsync_path(self.target.parent)

    def discard(self) -> None:
        """Step 4: close the file, remove it unless it landed, give the buffer back."""
        if self._fd is None:
            return
        os.close(self._fd)
        self._fd = None
        give_back(self._buffer)
        if not self.landed:
            self.path.unlink(missing_ok=True)
