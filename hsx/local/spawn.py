"""hsx services as child processes, the way a user runs them: ``python -m
hsx.cli ARGS`` with its output in a log file, its operations endpoint on a free
port and an environment without the model hub (:func:`cpu_engine_env`).

Each process starts a session (and process group) of its own, so a kill takes
vLLM's engine processes with it, as when a pod or a machine dies, and a Ctrl-C
in the terminal reaches only the parent, which then stops its children.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from contextlib import suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
import psutil

from hsx.local import with_parent
from hsx.local.broker import free_port
from hsx.local.scrape import get, metric, metric_sum


def cpu_engine_env(**overrides: str) -> dict[str, str]:
    """The environment for hsx child processes on a development machine: this
    process's, without the hub; ``overrides`` last (e.g.
    ``VLLM_CPU_OMP_THREADS_BIND="0"``). The extractor picks the CPU engine's KV cache
    and thread binding itself where these leave them unset
    (:mod:`hsx.extractor.cpu_defaults`)."""
    env = dict(os.environ)
    env["HF_HUB_OFFLINE"] = "1"
    env.update(overrides)
    return env


class ServiceError(RuntimeError):
    """A service exited, never became ready or did not drain in time; the
    message ends with the tail of its log."""


@dataclass
class HsxService:
    """``hsx ARGS`` as a restartable child process.

    Each start (an incarnation) logs to its own file in ``log_dir``:
    ``NAME.log``, then ``NAME.2.log``, ``NAME.3.log``... With ``health`` (the
    default; ``hsx produce`` has no endpoint) it gets ``--health-port`` on a free
    ``port``; with ``stats`` it writes its final statistics to
    ``NAME-stats.json`` (:meth:`read_stats`). Used as a context manager it is started
    on entry and killed on exit if still running.
    """

    name: str
    args: list[str]
    log_dir: Path
    env: dict[str, str] = field(default_factory=cpu_engine_env)
    health: bool = True
    stats: bool = False
    module: str = "hsx.cli"
    """What ``python -m`` runs: hsx's CLI, or e.g. vLLM's own OpenAI server
    (``vllm.entrypoints.openai.api_server``, with ``port_flag="--port"`` and
    ``ready_path="/health"``)."""
    port_flag: str = "--health-port"
    ready_path: str = "/readyz"
    with_parent: bool = False
    """SIGTERMed when this process dies, even by SIGKILL (:mod:`hsx.local.with_parent`;
    start it from a thread that lives as long as this process)."""
    python: str = sys.executable
    """The interpreter that runs ``module`` (``hsx train-draft``: speculators' environment)."""
    incarnations: int = field(default=0, init=False)
    proc: subprocess.Popen[bytes] | None = field(default=None, init=False)
    port: int = field(default=0, init=False)

    def start(self) -> HsxService:
        self.incarnations += 1
        extra: list[str] = []
        if self.health:
            self.port = free_port()
            extra += [self.port_flag, str(self.port)]
        if self.stats:
            self.stats_path.unlink(missing_ok=True)  # an earlier run's figures must not pass for this one's
            extra += ["--stats-file", str(self.stats_path)]
        argv = ["-m", self.module, *self.args, *extra]
        argv = with_parent.command(os.getpid(), argv, self.python) if self.with_parent else [self.python, *argv]
        with self.log_path().open("wb") as log:
            self.proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=self.env,
                                         start_new_session=True)
        return self

    def log_path(self, incarnation: int | None = None) -> Path:
        """The log of one incarnation (default: the latest)."""
        n = self.incarnations if incarnation is None else incarnation
        return self.log_dir / (f"{self.name}.log" if n <= 1 else f"{self.name}.{n}.log")

    @property
    def stats_path(self) -> Path:
        return self.log_dir / f"{self.name}-stats.json"

    @property
    def pid(self) -> int:
        assert self.proc is not None, f"{self.name} was never started"
        return self.proc.pid

    def exited(self) -> int | None:
        """The exit status, ``None`` while running (or never started)."""
        return None if self.proc is None else self.proc.poll()

    def wait(self, timeout: float | None = None) -> int:
        """Wait for the process to exit by itself; ``subprocess.TimeoutExpired``
        after ``timeout`` (it keeps running)."""
        assert self.proc is not None, f"{self.name} was never started"
        return self.proc.wait(timeout)

    def ready(self) -> bool:
        try:
            return get(self.port, self.ready_path)[0] == 200
        except OSError:
            return False

    def wait_ready(self, timeout: float = 300, stop: threading.Event | None = None) -> bool:
        """Wait until it answers its ready path: ``True``, or ``False`` once
        ``stop`` is set first; :class:`ServiceError` when it exits or ``timeout``
        passes."""
        deadline = time.monotonic() + timeout
        while not self.ready():
            if self.exited() is not None:
                raise ServiceError(f"{self.name} exited with {self.exited()} (log: {self.log_path()}):\n"
                                   f"{self.log_tail()}")
            if time.monotonic() > deadline:
                raise ServiceError(f"{self.name} not ready after {timeout}s (log: {self.log_path()}):\n"
                                   f"{self.log_tail()}")
            if stop is not None and stop.wait(0.2):
                return False
            if stop is None:
                time.sleep(0.2)
        return True

    def metric(self, name: str, labelled: bool = False) -> float:
        """An unlabelled series, or the sum of a labelled one; NaN when the
        process does not answer (or does not have the series yet)."""
        try:
            return (metric_sum if labelled else metric)(self.port, name)
        except (OSError, StopIteration):
            return float("nan")

    def counter(self, name: str) -> float:
        """A counter that should be moving: 0 until the endpoint serves it, and a
        :class:`ServiceError` once the process has exited."""
        if self.exited() is not None:
            raise ServiceError(f"{self.name} exited with {self.exited()}:\n{self.log_tail()}")
        value = self.metric(name)
        return 0.0 if value != value else value

    def signal(self, sig: signal.Signals) -> None:
        """Send ``sig`` to the whole process group (e.g. SIGSTOP, SIGCONT)."""
        os.killpg(self.pid, sig)

    def kill(self) -> None:
        """SIGKILL the whole process group, no warning, no cleanup."""
        with suppress(ProcessLookupError):  # the whole group is gone already
            os.killpg(self.pid, signal.SIGKILL)
        self.wait(30)

    def stop(self, timeout: float = 120) -> int:
        """SIGTERM (a drain: finish, flush, commit) and wait; returns the exit
        status. A service still running after ``timeout`` is killed."""
        assert self.proc is not None, f"{self.name} was never started"
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise ServiceError(f"{self.name} did not drain within {timeout}s:\n{self.log_tail()}") from None

    def drain(self, timeout: float, label: str | None = None) -> list[str]:
        """:meth:`stop`, for a summary: what went wrong, in one line each (it had
        exited already, did not drain within ``timeout``, or exited non-zero)."""
        who = label or self.name
        if self.exited() is not None:
            return [f"{who} exited with {self.exited()} (log: {self.log_path()})"]
        try:
            status = self.stop(timeout=timeout)
        except ServiceError as exc:
            return [str(exc).splitlines()[0]]
        return [] if status == 0 else [f"{who} exited with {status} on SIGTERM (log: {self.log_path()})"]

    def _tree(self) -> list[psutil.Process]:
        try:
            root = psutil.Process(self.pid)
            return [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return []

    def _tree_total(self, read: Callable[[psutil.Process], float]) -> float:
        total = 0.0
        for proc in self._tree():
            with suppress(psutil.NoSuchProcess):  # a child that just exited
                total += read(proc)
        return total

    def rss_bytes(self) -> int:
        """Resident memory of the process tree (vLLM's engine runs in children)."""
        return int(self._tree_total(lambda proc: proc.memory_info().rss))

    def cpu_seconds(self) -> float:
        """CPU time used so far by the process tree."""
        return self._tree_total(lambda proc: sum(proc.cpu_times()[:2]))  # user + system

    def child(self, name: str) -> int:
        """The pid of the tree's process named ``name`` (e.g. ``VLLM::EngineCore``)."""
        for proc in self._tree():
            with suppress(psutil.NoSuchProcess):
                if proc.name()[:15] == name[:15]:  # the kernel keeps 15 characters (psutil may add more)
                    return proc.pid
        raise ServiceError(f"no process {name} under {self.name}")

    def log_tail(self, chars: int = 3000) -> str:
        path = self.log_path()
        return path.read_text(errors="replace")[-chars:] if path.exists() else ""

    def logs(self) -> str:
        """Every incarnation's log, in order."""
        paths = [self.log_path(n) for n in range(1, self.incarnations + 1)]
        return "".join(p.read_text(errors="replace") for p in paths if p.exists())

    def read_stats(self) -> dict[str, Any]:
        """The final statistics the last incarnation wrote (``stats=True``); empty
        if it wrote none."""
        return orjson.loads(self.stats_path.read_bytes()) if self.stats_path.exists() else {}

    def __enter__(self) -> HsxService:
        return self.start()

    def __exit__(self, *_: object) -> None:
        if self.exited() is None:
            self.kill()
