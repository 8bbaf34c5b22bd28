"""The data path's malloc policy: freed buffers are reused, not handed back.

Both services churn through buffers of 100 KiB to a few MiB: block records and
librdkafka's copies of them, decoded samples, staged objects read from a store.
By default glibc maps each buffer past its mmap threshold on its own and unmaps
it when freed, and trims a heap once more than its trim threshold is free at the
top, so the next buffer lands on fresh pages: a page fault and a zeroed page each.
Fresh pages are the largest kernel cost on the data path: on the development
virtual machines, filling 1 GiB of fresh memory took 2.9 s of system time, and
0.1 s once the memory had been touched (a second fill of the same buffer).
The sink sets it at its start (``python -m bench.memory_policy`` compares the
policies; ``docs/benchmarks.md`` has the sink's figures with and without it).
"""

from __future__ import annotations

import ctypes
import logging

log = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1  # from malloc.h
_M_MMAP_THRESHOLD = -3
_M_ARENA_MAX = -8
MAX_MMAP_THRESHOLD = 32 << 20
"""glibc's ceiling for the mmap threshold on 64-bit systems: the largest buffer
it will take from a heap."""


def keep_freed_memory(up_to: int) -> None:
    """Let this process reuse up to ``up_to`` bytes of freed memory instead of
    returning it to the kernel: buffers up to :data:`MAX_MMAP_THRESHOLD` come
    from a heap, and a heap is trimmed only past ``up_to`` free bytes. The
    process's resident memory then stays at its high-water mark, which the
    service's memory budget bounds. Call it before the threads that allocate
    start. Nothing to do where libc is not glibc.

    Why one arena: glibc gives other threads (librdkafka's, the object store
    client's) arenas of their own, made of 64 MiB heaps that are unmapped as
    soon as they are empty, whatever the trim threshold. A thread that takes
    staged objects of a few MiB each from S3 emptied and mapped such heaps again
    and again: every byte on a fresh page (tests/unit/test_memory_policy.py)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return
    if not (libc.mallopt(_M_MMAP_THRESHOLD, MAX_MMAP_THRESHOLD) and libc.mallopt(_M_TRIM_THRESHOLD, up_to)
            and libc.mallopt(_M_ARENA_MAX, 1)):
        log.warning("mallopt refused the data path's malloc policy: freed buffers go back to the kernel")
