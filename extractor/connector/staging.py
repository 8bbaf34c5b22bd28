"""By reference (``hsx extract --payload-store``): each attempt's blocks are
encoded and written, in order, back to back into one staged object at
:func:`hsx.schemas.staged_key` in the payload store, by one thread of the
stager's pool (each block as the pieces it was encoded in). The write is
streamed (a multipart upload on S3, parts of the store's part size; on a
directory, around the page cache), so memory holds one block, never the object;
the object is durable when the upload completes, and absent if it failed."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor

from typing_extensions import Buffer

from hsx.dataset.storage import open_storage
from hsx.schemas import staged_key


class Stager:
    """Writes staged objects on a pool of ``threads`` (attempts staged at once)."""

    def __init__(self, payload_store: str, threads: int) -> None:
        self._store = open_storage(payload_store, create=True)
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="hsx-stage")

    def stage(self, request_id: str, attempt_id: str, blocks: Iterable[list[Buffer]],
              done: Callable[[BaseException | None], None]) -> None:
        """Stage an attempt whose blocks (each as its pieces) ``blocks`` yields in
        order. ``blocks`` is consumed on the pool's thread that writes them, so a
        lazy one encodes each block where it is written: a transfer holds one
        encoded block at a time, and none waits for another thread. ``done`` is
        called from the pool once the object is durable (None), or with the
        error that stopped it, ``blocks``' own included (the object is then
        absent)."""
        future = self._pool.submit(self._write, staged_key(request_id, attempt_id), blocks)

        def finished(f: Future[None]) -> None:
            done(f.exception())

        future.add_done_callback(finished)

    def _write(self, key: str, blocks: Iterable[list[Buffer]]) -> None:
        # Around the page cache: the sink reads the object on its own node (the folder is shared), if not
        # soon, and around the cache too; written through it, each byte would first take a fresh page of
        # the GPU node's memory (bench.datapath: up to 4-9 CPU-s per GB in the hours when those are dear).
        with self._store.open_atomic(key, cache=False) as out:
            for pieces in blocks:
                for piece in pieces:
                    out.write(piece)

    def close(self) -> None:
        """Wait for the uploads under way."""
        self._pool.shutdown(wait=True)
