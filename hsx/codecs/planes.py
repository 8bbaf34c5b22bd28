"""Byte planes: a block's little-endian elements cut into planes (every
element's byte 0, then every element's byte 1, ...) and put back together, in
per-thread buffers that are reused (fresh pages per block cost as much as zstd)."""

from __future__ import annotations

import threading

import numpy as np

WORDS = {2: np.dtype("<u2"), 4: np.dtype("<u4")}
"""The unsigned integer of each element size the planes are cut from."""
SCRATCH_MAX = 32 << 20
"""Blocks up to this many raw bytes use per-thread buffers that are kept;
larger ones (not cut by the connector) get buffers of their own."""

_local = threading.local()


def split_planes(view: memoryview, itemsize: int) -> np.ndarray:
    """``[itemsize, count]``: row i holds byte i of every little-endian element,
    in a reused per-thread buffer (valid until this thread's next call).

    Why shifts: byte i of an element is its word shifted right by ``8 * i`` and
    truncated, which numpy runs at memory speed (the shift writes its plane
    directly, narrowing in cache-sized chunks; through a word-sized temporary it
    took 1.8x the CPU); the transposing copy this replaced
    (``reshape(-1, itemsize).T.copy()``) wrote bytes with a stride and ran at
    about half of it, into fresh pages every block."""
    count = view.nbytes // itemsize
    planes = scratch("split", view.nbytes).reshape(itemsize, count)
    words = np.frombuffer(view, dtype=WORDS[itemsize])
    np.copyto(planes[0], words, casting="unsafe")  # unsigned narrowing keeps the low byte
    for i in range(1, itemsize):
        np.right_shift(words, 8 * i, out=planes[i], casting="unsafe")
    return planes


def interleave_planes(planes: np.ndarray, target: np.ndarray) -> np.ndarray:
    """The elements whose byte planes are ``planes`` (``[itemsize, count]``), written
    into ``target`` (``itemsize * count`` uint8) and returned as its words.

    Why this shape: widening the top plane to the element's little-endian integer
    and shifting each lower plane in runs at memory speed, where writing bytes
    with an element-sized stride (``np.stack(..., axis=1)``) did not."""
    words = target.view(WORDS[planes.shape[0]])
    np.copyto(words, planes[-1])
    for plane in planes[-2::-1]:
        words <<= 8
        words |= plane
    return words


def scratch(name: str, nbytes: int) -> np.ndarray:
    """A per-thread uint8 buffer of at least ``nbytes``, reused across calls."""
    if nbytes > SCRATCH_MAX:
        return np.empty(nbytes, dtype=np.uint8)
    buffers = _local.__dict__.setdefault("scratch", {})
    buffer = buffers.get(name)
    if buffer is None or buffer.nbytes < nbytes:
        buffer = buffers[name] = np.empty(max(nbytes, 1 << 20), dtype=np.uint8)
    return buffer[:nbytes]
