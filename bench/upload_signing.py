"""``python -m bench.upload_signing [--quick]``: what signing an upload's payload
costs the uploading process.

SigV4 signs a request's body by hashing it (SHA-256) unless the request says
``UNSIGNED-PAYLOAD``; hsx sends unsigned payloads over TLS and signed ones over
plain HTTP (:func:`hsx.dataset.storage.s3.store_config`). Here one process
uploads the same bytes through :meth:`~hsx.dataset.storage.s3.S3Storage.open_atomic`
(1 MiB writes, as the stager and the shard writer make them) both ways to the
local SeaweedFS, rounds interleaved: CPU-seconds (user + system) of this process
per GB uploaded, median round. The bytes are random; nothing here compresses them.

Figures merge into ``bench/results.json`` as ``upload_signing_*`` keys.
"""

from __future__ import annotations

import os
import resource
import statistics
import uuid

import numpy as np

from bench.sink_scale import standalone
from hsx.dataset.storage import s3 as s3_storage
from hsx.local.s3server import dev_s3

WRITE_BYTES = 1 << 20
BUCKET = "hsx-bench-signing"


def upload_cpu_s(url: str, data: np.ndarray, objects: int, unsigned: bool) -> float:
    """CPU-seconds this process spent uploading ``objects`` copies of ``data`` to ``url``."""
    config = {"unsigned_payload": True} if unsigned else {}
    original, s3_storage.store_config = s3_storage.store_config, lambda endpoint: config
    try:
        storage = s3_storage.S3Storage(url)
        before = resource.getrusage(resource.RUSAGE_SELF)
        for i in range(objects):
            with storage.open_atomic(f"object-{i}") as out:
                for start in range(0, data.nbytes, WRITE_BYTES):
                    out.write(memoryview(data[start:start + WRITE_BYTES]))
        after = resource.getrusage(resource.RUSAGE_SELF)
    finally:
        s3_storage.store_config = original
    return after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime


def run(quick: bool) -> dict[str, object]:
    rounds, objects = (1, 1) if quick else (3, 4)
    data = np.random.default_rng(0).integers(0, 256, (16 if quick else 64) << 20, dtype=np.uint8)
    gb = objects * data.nbytes / 1e9
    per_gb: dict[str, list[float]] = {"signed": [], "unsigned": []}
    with dev_s3() as s3:
        s3.create_bucket(BUCKET)
        os.environ.update(s3.environ())
        for r in range(rounds):
            for side in ("signed", "unsigned") if r % 2 == 0 else ("unsigned", "signed"):
                url = f"s3://{BUCKET}/{side}-{uuid.uuid4().hex[:8]}"
                per_gb[side].append(upload_cpu_s(url, data, objects, side == "unsigned") / gb)
    signed, unsigned = (statistics.median(per_gb[side]) for side in ("signed", "unsigned"))
    return {"upload_signing_quick": quick, "upload_signing_rounds": rounds, "upload_signing_gb_per_round": round(gb, 3),
            "upload_signing_signed_cpu_s_per_gb": round(signed, 3),
            "upload_signing_unsigned_cpu_s_per_gb": round(unsigned, 3),
            "upload_signing_saved_cpu_s_per_gb": round(signed - unsigned, 3),
            "upload_signing_rounds_cpu_s_per_gb": {side: [round(v, 3) for v in values]
                                                   for side, values in per_gb.items()}}


def main() -> None:
    standalone(__doc__, "16 MiB, one round: a smoke check", run)


if __name__ == "__main__":
    main()
