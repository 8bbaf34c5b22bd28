"""hsx.local.with_parent: a child started under the guard ends when its parent is
SIGKILLed (what keeps a killed ``hsx serve`` from leaving vLLM's server running);
one started without it outlives the parent, which is why the guard exists."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from hsx.local import with_parent

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl(PR_SET_PDEATHSIG) is Linux's")

PARENT = """
import os, subprocess, sys, time
from hsx.local import with_parent
guarded_exec = subprocess.Popen(with_parent.command(os.getpid(), ["sleep", "600"]), start_new_session=True)
guarded_module = subprocess.Popen(with_parent.command(os.getpid(), ["-m", "http.server", "0", "--bind", "127.0.0.1"]),
                                  start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
unguarded = subprocess.Popen(["sleep", "600"], start_new_session=True)
print(guarded_exec.pid, guarded_module.pid, unguarded.pid, flush=True)
time.sleep(600)
"""


def _gone(pid: int, within: float) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.1)
    return False


def test_children_under_the_guard_end_with_a_killed_parent_and_others_do_not() -> None:
    parent = subprocess.Popen([sys.executable, "-c", PARENT], stdout=subprocess.PIPE, text=True)
    assert parent.stdout is not None
    pids = [int(p) for p in parent.stdout.readline().split()]
    guarded_exec, guarded_module, unguarded = pids
    try:
        time.sleep(1.0)  # the module child past its import, serving
        assert all(psutil.pid_exists(p) for p in pids)
        parent.kill()
        parent.wait()
        assert _gone(guarded_exec, 10) and _gone(guarded_module, 10)
        assert not _gone(unguarded, 1)  # without the guard: left running
    finally:
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def test_a_child_whose_parent_is_gone_already_exits_at_once() -> None:
    """The parent died before the guard was set (it would never fire): the child
    does not start its program."""
    run = subprocess.run(with_parent.command(os.getpid() + 10_000_000, ["sleep", "600"]), timeout=30, check=False)
    assert run.returncode == with_parent.EXIT_ORPHANED
