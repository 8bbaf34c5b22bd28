"""``python -m bench.direct_write [--quick]``: what a shard's write into the page
cache costs, and what writing it around the cache (``O_DIRECT``,
:mod:`hsx.dataset.storage.direct_file`, as the sink writes shards) saves.

One process per way and round writes a shard-sized file through
:meth:`~hsx.dataset.storage.LocalStorage.open_atomic` in 1 MiB writes (a block
record's size) from one reused buffer, into a temporary folder on the disk the
checkout is on: 1 GiB a round, 3 rounds, the ways interleaved. CPU-seconds
(user + system) per GB and MB/s (fsync included), median round. ``cached``: a
buffered write (the sink before); ``direct``: around the page cache.

Figures merge into ``bench/results.json`` as ``direct_write_*`` keys.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.sink_scale import ROOT, standalone

WAYS = ("cached", "direct")
PIECE = 1 << 20

WRITE = """
import json, os, resource, sys, time
from pathlib import Path
from hsx.dataset.storage import LocalStorage
way, folder, total = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3])
piece = os.urandom({piece})
storage = LocalStorage(folder)
before, start = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
with storage.open_atomic("shard.safetensors", cache=way == "cached") as out:
    for _ in range(total // {piece}):
        out.write(piece)
seconds = time.perf_counter() - start
after = resource.getrusage(resource.RUSAGE_SELF)
storage.delete("shard.safetensors")
print(json.dumps({{"cpu_s": after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime,
                  "system_s": after.ru_stime - before.ru_stime, "seconds": seconds}}))
""".format(piece=PIECE)


def write(way: str, folder: Path, total: int) -> dict[str, float]:
    done = subprocess.run([sys.executable, "-c", WRITE, way, str(folder), str(total)],
                          capture_output=True, text=True, check=True)
    return json.loads(done.stdout)


def run(quick: bool) -> dict[str, object]:
    rounds, total = (1, 128 << 20) if quick else (3, 1 << 30)
    gb = total / 1e9
    measured: dict[str, list[dict[str, float]]] = {way: [] for way in WAYS}
    scratch = ROOT / ".cache"  # on the checkout's disk (often not /tmp's), ignored by git
    scratch.mkdir(exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="bench-direct-write-", dir=scratch) as folder:
        for r in range(rounds):
            for way in WAYS[r % 2:] + WAYS[:r % 2]:  # each goes first in turn
                measured[way].append(write(way, Path(folder), total))
    results: dict[str, object] = {"direct_write_quick": quick, "direct_write_rounds": rounds,
                                  "direct_write_gb_per_round": round(gb, 3)}
    for way, rows in measured.items():
        for figure in ("cpu_s", "system_s"):
            results[f"direct_write_{way}_{figure}_per_gb"] = round(statistics.median(r[figure] for r in rows) / gb, 3)
        results[f"direct_write_{way}_cpu_s_per_gb_rounds"] = [round(r["cpu_s"] / gb, 3) for r in rows]
        results[f"direct_write_{way}_mb_s"] = round(gb * 1e3 / statistics.median(r["seconds"] for r in rows), 1)
    return results


def main() -> None:
    standalone(__doc__, "128 MiB, one round: a smoke check", run)


if __name__ == "__main__":
    main()
