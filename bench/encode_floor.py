"""``python -m bench.encode_floor [--quick]``: the least CPU the connector side
can spend per GB with its codec, the yardstick for ``bench.datapath``'s
connector figure.

The same hidden states as ``bench.datapath`` (SmolLM2-135M, bfloat16), as
requests of 1,024 tokens cut into blocks the way the connector cuts them by
reference (:data:`~hsx.schemas.connector.STAGED_BLOCK_BYTES`); each request's
blocks encoded (:func:`~hsx.codecs.block.encode_block_record`) and written in
order to one object with the stager's own writer (a directory store, around
the page cache), then the object deleted. Nothing else: no Kafka, no manifest,
no completion report, no hand-off between threads (each thread encodes and
writes its own requests). Sides: codec ``byteplane-zstd`` (the default) and
``none``, on one thread and on two; rounds interleaved; CPU-seconds (user +
system) of this process per GB of raw hidden states, median round.

Figures merge into ``bench/results.json`` as ``encode_floor_*`` keys.
"""

from __future__ import annotations

import gc
import itertools
import resource
import statistics
import tempfile
import threading

import torch

from bench.sink_scale import standalone
from hsx.codecs.block import encode_block_record
from hsx.dataset.storage import open_storage
from hsx.dataset.storage.base import Storage
from hsx.extractor.connector.gather import Gathered
from hsx.extractor.connector.records import block_ranges
from hsx.schemas.blocks import Codec, DType
from hsx.schemas.connector import STAGED_BLOCK_BYTES

REQUEST_TOKENS = 1024
CODECS = (Codec.BYTEPLANE_ZSTD, Codec.NONE)
THREADS = (1, 2)


def stage(store: Storage, key: str, request: torch.Tensor, codec: Codec) -> None:
    """Encode one request's blocks and write them, in order, into one object (then delete it)."""
    with store.open_atomic(key, cache=False) as out:
        for start, end in block_ranges(Gathered(tensor=request), STAGED_BLOCK_BYTES):
            rows = request[start:end]
            record = encode_block_record(rows.view(torch.uint8).numpy(), shape=tuple(rows.shape),  # type: ignore[arg-type]
                                         dtype=DType.BFLOAT16, token_start=start, codec=codec)
            for piece in record.pieces:
                out.write(piece)
    store.delete(key)


def cpu_s_per_gb(store: Storage, rows: torch.Tensor, requests: int, codec: Codec, threads: int) -> float:
    """CPU-seconds per GB of ``threads`` threads staging ``requests`` requests between them."""
    starts = [(i * 977) % (rows.shape[0] - REQUEST_TOKENS) for i in range(requests)]

    def work(first: int) -> None:
        for i in range(first, requests, threads):
            stage(store, f"{codec.value}-{threads}-{i}", rows[starts[i]:starts[i] + REQUEST_TOKENS], codec)

    before = resource.getrusage(resource.RUSAGE_SELF)
    workers = [threading.Thread(target=work, args=(k,)) for k in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    after = resource.getrusage(resource.RUSAGE_SELF)
    gb = requests * REQUEST_TOKENS * rows[0].numel() * rows.element_size() / 1e9
    return (after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime) / gb


def label(codec: Codec, threads: int) -> str:
    """A side's name in the results: codec and threads."""
    return f"{codec.value.replace('-', '_')}_{threads}"


def run(quick: bool) -> dict[str, object]:
    from bench.codec import smollm2_samples

    rows = torch.cat([s.to(torch.bfloat16) for s in (smollm2_samples()[:4] if quick else smollm2_samples())])
    while rows.shape[0] < 2 * REQUEST_TOKENS:
        rows = torch.cat([rows, rows])
    rounds = 1 if quick else 3
    requests = max(2, int((0.05 if quick else 0.75) * 2**30 / (REQUEST_TOKENS * rows[0].numel() * 2)))
    sides = list(itertools.product(CODECS, THREADS))
    per_gb: dict[str, list[float]] = {label(codec, threads): [] for codec, threads in sides}
    with tempfile.TemporaryDirectory(prefix="hsx-bench-floor-") as folder:
        store = open_storage(folder, create=True)
        for codec, threads in sides:  # warm: per-thread buffers, zstd contexts
            cpu_s_per_gb(store, rows, threads, codec, threads)
        gc.collect()
        gc.freeze()  # as the connector does once its sender exists
        for r in range(rounds):
            for codec, threads in sides[r % len(sides):] + sides[:r % len(sides)]:
                per_gb[label(codec, threads)].append(cpu_s_per_gb(store, rows, requests, codec, threads))
    gb = requests * REQUEST_TOKENS * rows[0].numel() * 2 / 1e9
    return {"encode_floor_quick": quick, "encode_floor_rounds": rounds, "encode_floor_gb_per_round": round(gb, 3),
            "encode_floor_block_bytes": STAGED_BLOCK_BYTES,
            **{f"encode_floor_{name}_threads_cpu_s_per_gb": round(statistics.median(values), 3)
               for name, values in per_gb.items()},
            "encode_floor_rounds_cpu_s_per_gb": {name: [round(v, 3) for v in values] for name, values in per_gb.items()}}


def main() -> None:
    standalone(__doc__, "0.05 GiB, one round: a smoke check", run)


if __name__ == "__main__":
    main()
