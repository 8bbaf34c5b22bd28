"""By reference (``hsx extract --payload-store``): each attempt's block record
values go, in order as they are encoded (each as the pieces it was encoded in),
back to back into one staged object at :func:`hsx.schemas.staged_key` in the
payload store. The write is streamed (a multipart upload on S3, parts of the
store's part size; on a directory, around the page cache), so memory holds the
blocks not yet written, never the object; the object is durable when the
upload completes, and absent if it was given up."""

from __future__ import annotations

import queue
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

from typing_extensions import Buffer

from hsx.dataset.storage import open_storage
from hsx.schemas import staged_key


class _GaveUp(Exception):
    """The attempt failed before every block was staged: the upload is aborted."""


class Stager:
    """Writes staged objects on a pool of ``threads`` (attempts staged at once)."""

    def __init__(self, payload_store: str, threads: int) -> None:
        self._store = open_storage(payload_store, create=True)
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="hsx-stage")

    def start(self, request_id: str, attempt_id: str, blocks: int,
              done: Callable[[BaseException | None], None]) -> queue.SimpleQueue[list[Buffer] | None]:
        """Stage an attempt of ``blocks`` blocks: put their values (each as its
        pieces) on the returned queue in order (never blocks), or None to give
        up. ``done`` is called from the pool once the object is durable (None),
        or with the error that stopped it (not when given up)."""
        values: queue.SimpleQueue[list[Buffer] | None] = queue.SimpleQueue()
        future = self._pool.submit(self._write, staged_key(request_id, attempt_id), blocks, values)

        def finished(f: Future[None]) -> None:
            error = f.exception()
            done(None if isinstance(error, _GaveUp) else error)

        future.add_done_callback(finished)
        return values

    def _write(self, key: str, blocks: int, values: queue.SimpleQueue[list[Buffer] | None]) -> None:
        # Around the page cache: the sink reads the object on its own node (the folder is shared), if not
        # soon, and around the cache too; written through it, each byte would first take a fresh page of
        # the GPU node's memory (bench.datapath: up to 4-9 CPU-s per GB in the hours when those are dear).
        with self._store.open_atomic(key, cache=False) as out:
            for _ in range(blocks):
                pieces = values.get()
                if pieces is None:
                    raise _GaveUp
                for piece in pieces:
                    out.write(piece)

    def close(self) -> None:
        """Wait for the uploads under way (every one of them is fed or given up by then)."""
        self._pool.shutdown(wait=True)
