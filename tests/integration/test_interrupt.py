"""Ctrl-C (SIGINT) in the middle of ``hsx run``, ``hsx demo`` and ``hsx broker``,
as a terminal sends it to the foreground process: the command exits promptly
with its documented code and leaves no process behind (broker, services,
vLLM's engine processes); an interrupted run then resumes to completion.

Every process a command starts inherits a marker variable, so a process that
outlived its parent is found wherever it was re-parented."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import orjson
import psutil
import pytest

from hsx import models
from hsx.dataset.reader import open_dataset
from hsx.runtime.errors import ExitCode

pytestmark = [pytest.mark.integration, pytest.mark.faults]

ENGINE = ["--dtype", "float32", "--enforce-eager", "--max-model-len", "256"]
EXIT_WITHIN = 30.0
"""Seconds from SIGINT to the command's exit: no drain, the children are killed."""
GONE_WITHIN = 10.0
"""Seconds after the command's exit by which its last descendant must be gone."""
MARK = "CTRL_C_TEST_MARK"


def _env(mark: str) -> dict[str, str]:
    """A plain shell's environment (the model cache aside) plus the marker."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VLLM_", "HSX_")) or k == models.CACHE_DIR_ENV}
    env[MARK] = mark
    return env


def _as_in_a_terminal() -> None:
    """A command typed in a terminal gets SIGINT's default action. A test run
    started in the background of a non-interactive shell (``make test &``, CI)
    inherits it ignored, and so would the command, which could then not be
    interrupted at all."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _marked(mark: str) -> list[psutil.Process]:
    found = []
    for proc in psutil.process_iter():
        try:
            if proc.environ().get(MARK) == mark:
                found.append(proc)
        except psutil.Error:  # gone meanwhile, or a kernel thread
            continue
    return found


def _name(proc: psutil.Process) -> str:
    try:
        return proc.name()
    except psutil.Error:
        return ""


def _engine_started(tree: list[psutil.Process]) -> bool:
    """True once a vLLM engine process (``VLLM::EngineCore``...) runs under the command."""
    return any(_name(p).startswith("VLLM") for p in tree)


def _services_started(output: Path) -> Callable[[list[psutil.Process]], bool]:
    """True once ``hsx run`` (or the demo) has started its services: their logs
    appear in ``OUTPUT/logs`` before their engines load, so the interrupt lands
    while there is work in flight however fast the model is."""
    return lambda _tree: (output / "logs" / "extractor.log").exists()


def _interrupt(argv: list[str], log: Path, in_the_middle: Callable[[list[psutil.Process]], bool],
               start_timeout: float = 300) -> tuple[int, str]:
    """Start ``hsx ARGV``, wait until ``in_the_middle(its process tree)`` holds,
    SIGINT the command (only it, as a terminal would: its children have sessions
    of their own), and check that it exits in time and leaves nothing behind."""
    mark = uuid.uuid4().hex
    seen: dict[int, psutil.Process] = {}  # every descendant ever seen: vLLM's renamed ones lose the marker

    def tree() -> list[psutil.Process]:
        try:
            procs = psutil.Process(proc.pid).children(recursive=True)
        except psutil.Error:
            procs = []
        seen.update((p.pid, p) for p in procs)
        return procs

    with log.open("wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "hsx.cli", *argv], stdout=out, stderr=subprocess.STDOUT,
                                env=_env(mark), preexec_fn=_as_in_a_terminal)
    try:
        deadline = time.monotonic() + start_timeout
        while not in_the_middle(tree()):
            assert proc.poll() is None, f"exited with {proc.returncode} before it could be interrupted"
            assert time.monotonic() < deadline, f"not ready to interrupt within {start_timeout}s"
            time.sleep(0.2)
        time.sleep(1.0)
        assert tree(), "nothing started under the command"
        proc.send_signal(signal.SIGINT)
        deadline = time.monotonic() + EXIT_WITHIN
        while proc.poll() is None:  # the tree, until the end: catch a process started during shutdown
            tree()
            assert time.monotonic() < deadline, f"still running {EXIT_WITHIN}s after SIGINT"
            time.sleep(0.1)
        left = [p for p in [*seen.values(), *_marked(mark)] if p.is_running()]
        _gone, alive = psutil.wait_procs(left, timeout=GONE_WITHIN)
        assert not alive, f"left behind: {[(p.pid, _name(p)) for p in alive]} of {[_name(p) for p in seen.values()]}"
    finally:
        for left_over in [*seen.values(), *_marked(mark)]:
            with contextlib.suppress(psutil.Error):
                left_over.kill()
        if proc.poll() is None:
            proc.kill()
    return proc.returncode, log.read_text(errors="replace")


def _prompts(path: Path, n: int) -> list[str]:
    ids = [f"int-{i}" for i in range(n)]
    path.write_bytes(b"".join(orjson.dumps({"request_id": r, "prompt": f"prompt {r} about drafts"}) + b"\n"
                              for r in ids))
    return ids


@pytest.mark.engine
def test_ctrl_c_stops_hsx_run_and_a_rerun_completes(tmp_path: Path) -> None:
    model = models.prepare(names=["tiny-llama"])["tiny-llama"]
    ids = _prompts(tmp_path / "prompts.jsonl", 24)
    output = tmp_path / "dataset"
    argv = ["run", str(tmp_path / "prompts.jsonl"), "--model", str(model), "--output", str(output), "--no-progress",
            *ENGINE]

    status, log = _interrupt(argv, tmp_path / "interrupted.log", _services_started(output))
    assert status == ExitCode.INTERRUPTED == 130, log
    assert "hsx run: interrupted; run the same command again to resume" in log
    assert "Traceback" not in log

    again = subprocess.run([sys.executable, "-m", "hsx.cli", *argv], env=_env("rerun"), capture_output=True,
                           text=True, timeout=600)
    assert again.returncode == 0, again.stdout + again.stderr[-4000:]
    assert sorted(open_dataset(output).request_ids()) == sorted(ids)


@pytest.mark.engine
def test_ctrl_c_stops_hsx_demo_and_a_rerun_completes(tmp_path: Path) -> None:
    """The S3 demo: its SeaweedFS server is one more child that must not outlive a Ctrl-C."""
    models.prepare(names=["smollm2-135m-instruct"])
    argv = ["demo", "--s3", "--output", str(tmp_path / "demo"), "--no-progress"]
    status, log = _interrupt(argv, tmp_path / "demo.log", _services_started(tmp_path / "demo"))
    assert status == ExitCode.INTERRUPTED, log
    assert "hsx demo: interrupted (Ctrl-C)" in log
    assert "Traceback" not in log

    # The demo empties its output and starts again (about a minute).
    again = subprocess.run([sys.executable, "-m", "hsx.cli", *argv], env=_env("rerun"), capture_output=True,
                           text=True, timeout=600)
    assert again.returncode == 0, again.stdout + again.stderr[-4000:]
    assert "[demo] OK: dataset in s3://hsx-demo/demo" in again.stdout


def test_ctrl_c_stops_hsx_broker(tmp_path: Path) -> None:
    log = tmp_path / "broker.log"
    listening = re.compile(rb"^127\.0\.0\.1:\d+$", re.MULTILINE)  # the address it prints once ready
    status, text = _interrupt(["broker"], log, lambda _tree: bool(listening.search(log.read_bytes())),
                              start_timeout=60)
    assert status == ExitCode.OK, text  # stopping is what Ctrl-C is for here


@pytest.mark.engine
def test_ctrl_c_while_hsx_extract_loads_its_model(kafka_bootstrap: str, tmp_path: Path) -> None:
    """Nothing is consumed while the engine starts, so there is nothing to drain:
    the load is abandoned at once (vLLM's own start-up would swallow the
    interrupt and finish loading first)."""
    model = models.prepare(names=["tiny-llama"])["tiny-llama"]
    argv = ["extract", "--bootstrap", kafka_bootstrap, "--topic", f"int-{uuid.uuid4().hex[:8]}", "--model", str(model),
            *ENGINE]
    status, log = _interrupt(argv, tmp_path / "extract.log", _engine_started)
    assert status == ExitCode.INTERRUPTED, log
    assert "stopping while the model loads" in log and "Traceback" not in log
    assert "hsx.runtime.kafka.member: assigned" not in log  # it never joined the group (vLLM logs "assigned" too)
