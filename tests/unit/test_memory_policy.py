"""The data path's malloc policy (hsx.runtime.memory): buffers freed and taken
again land on the memory they left, not on fresh pages (each a fault and a
zeroing by the kernel). Each case runs in a process of its own: the policy is
process-wide."""

from __future__ import annotations

import json
import subprocess
import sys

CHURN = """
import json, resource, sys
from hsx.runtime.memory import keep_freed_memory
if sys.argv[1] == "keep":
    keep_freed_memory(64 << 20)
faults = []
for _ in range(8):  # a budget's worth of record-sized buffers held, then freed, again and again
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    buffers = [bytearray(4 << 20) for _ in range(8)]
    del buffers
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(json.dumps(faults))
"""


THREAD_CHURN = """
import json, queue, resource, sys, threading
from hsx.runtime.memory import keep_freed_memory
if sys.argv[1] == "keep":
    keep_freed_memory(512 << 20)
jobs, done = queue.Queue(), queue.Queue()
def worker():  # as an object store client's thread: it allocates, the service's thread frees
    while True:
        done.put([bytearray(20 << 20) for _ in range(jobs.get())])
threading.Thread(target=worker, daemon=True).start()
faults = []
for _ in range(6):  # more than one of glibc's 64 MiB thread heaps held, then freed
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    jobs.put(8)
    buffers = done.get()
    del buffers
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(json.dumps(faults))
"""


def churn(policy: str, script: str = CHURN) -> list[int]:
    done = subprocess.run([sys.executable, "-c", script, policy], capture_output=True, text=True, check=True)
    return json.loads(done.stdout)


def test_freed_buffers_are_reused_without_page_faults() -> None:
    first, *again = churn("keep")
    assert first >= 32 * 256 * 0.9  # 32 MiB of 4 KiB pages touched once
    assert sum(again) <= len(again) * first // 100, again


def test_without_the_policy_the_same_churn_faults_every_round() -> None:
    """The control: glibc's defaults trim the freed buffers, so each round pays again."""
    first, *again = churn("default")
    assert min(again) >= first // 2, again


def test_buffers_another_thread_took_are_reused_too() -> None:
    """glibc unmaps a thread arena's empty heaps whatever the trim threshold: the
    policy keeps every thread on the main arena, whose memory it keeps."""
    first, *again = churn("keep", THREAD_CHURN)
    assert first >= 160 * 256 * 0.9  # 160 MiB of 4 KiB pages touched once
    assert sum(again) <= len(again) * first // 100, again


def test_without_the_policy_another_threads_buffers_fault_every_round() -> None:
    first, *again = churn("default", THREAD_CHURN)
    assert min(again) >= first // 2, again
