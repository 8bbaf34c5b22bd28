"""``python -m bench.memory_policy [--quick]``: what fresh pages cost, and what
the data path's malloc policy (:func:`hsx.runtime.memory.keep_freed_memory`) saves.

One process per policy and round (the policy is process-wide) copies record-sized
buffers (1 MiB, as a record's value or a staged object arrives) through a window
of 64 MiB held at once (a memory budget's worth, oldest freed first), 2 GiB in
all: CPU-seconds (user + system) and page faults per GB copied, median round,
the policies interleaved. ``default``: glibc's own thresholds; ``mapped``: each
large buffer mapped on its own (the sink's policy before); ``keep``: freed
buffers reused. Fresh pages are what the kernel faults in and zeroes.

Figures merge into ``bench/results.json`` as ``memory_policy_*`` keys.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys

from bench.sink_scale import standalone

POLICIES = ("default", "mapped", "keep")
BUFFER = 1 << 20
WINDOW = 64

CHURN = """
import collections, ctypes, json, resource, sys
from hsx.runtime.memory import keep_freed_memory
policy, total = sys.argv[1], int(sys.argv[2])
if policy == "keep":
    keep_freed_memory({window} * {buffer})
elif policy == "mapped":
    ctypes.CDLL("libc.so.6").mallopt(-3, 128 << 10)
source = bytes(range(256)) * ({buffer} // 256)
held = collections.deque()
before = resource.getrusage(resource.RUSAGE_SELF)
for _ in range(total // {buffer}):
    held.append(bytearray(source))
    if len(held) > {window}:
        held.popleft()
after = resource.getrusage(resource.RUSAGE_SELF)
print(json.dumps({{"cpu_s": after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime,
                  "system_s": after.ru_stime - before.ru_stime, "faults": after.ru_minflt - before.ru_minflt}}))
""".format(window=WINDOW, buffer=BUFFER)


def churn(policy: str, total: int) -> dict[str, float]:
    done = subprocess.run([sys.executable, "-c", CHURN, policy, str(total)], capture_output=True, text=True, check=True)
    return json.loads(done.stdout)


def run(quick: bool) -> dict[str, object]:
    rounds, total = (1, 256 << 20) if quick else (3, 2 << 30)
    gb = total / 1e9
    measured: dict[str, list[dict[str, float]]] = {policy: [] for policy in POLICIES}
    for r in range(rounds):
        for policy in POLICIES[r % 3:] + POLICIES[:r % 3]:  # each goes first once in three
            measured[policy].append(churn(policy, total))
    results: dict[str, object] = {"memory_policy_quick": quick, "memory_policy_rounds": rounds,
                                  "memory_policy_gb_per_round": round(gb, 3)}
    for policy, rows in measured.items():
        for figure in ("cpu_s", "system_s"):
            results[f"memory_policy_{policy}_{figure}_per_gb"] = round(statistics.median(r[figure] for r in rows) / gb, 3)
        results[f"memory_policy_{policy}_faults_per_gb"] = round(statistics.median(r["faults"] for r in rows) / gb)
    return results


def main() -> None:
    standalone(__doc__, "256 MiB, one round: a smoke check", run)


if __name__ == "__main__":
    main()
