"""``hsx serve --draft D --learn`` as one command, from a plain shell's
environment: the server answers while ``hsx train-draft`` trains the served
draft on its traffic and the gate judges every checkpoint; the trainer killed
(-9) leaves the server serving with its draft, and hsx serve starts the trainer
again, which resumes from its checkpoint; SIGTERM stops everything, exit 0,
every answered request's sample in the dataset once."""

from __future__ import annotations

import os
import re
import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest

from hsx import models
from hsx.dataset.reader import open_dataset
from hsx.local.broker import free_port
from hsx.local.scrape import metric, metric_sum
from hsx.local.spawn import HsxService, cpu_engine_env
from hsx.trainer.gate import decisions

pytestmark = [pytest.mark.integration, pytest.mark.engine, pytest.mark.faults]


@contextmanager
def _traffic(port: int, model: Path, answered: list[dict[str, Any]]) -> Iterator[None]:
    """Eight clients sending greedy completions until the block ends."""
    stop = threading.Event()

    def client(n: int) -> None:
        k = 0
        while not stop.is_set():
            k += 1
            try:
                response = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=60, json={
                    "model": str(model), "prompt": [5, 17, 300, n, k % 50], "max_tokens": 24, "temperature": 0,
                    "ignore_eos": True})
            except httpx.HTTPError:
                return
            if response.status_code == 200:
                answered.append(response.json())

    clients = [threading.Thread(target=client, args=(n,)) for n in range(8)]
    for thread in clients:
        thread.start()
    try:
        yield
    finally:
        stop.set()
        for thread in clients:
            thread.join(120)


def _until(check: Any, what: str, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, what
        time.sleep(1)


def _trainer(serve: HsxService) -> psutil.Process:
    """hsx serve's trainer child (``train-draft`` in speculators' environment)."""
    for child in psutil.Process(serve.pid).children(recursive=True):
        if "train-draft" in child.cmdline():
            return child
    raise AssertionError("no trainer running")


def test_learn_trains_judges_survives_a_killed_trainer_and_stops_cleanly(tmp_path: Path) -> None:
    prepared = models.prepare(names=["tiny-llama", "tiny-llama-eagle3"])
    model, port, health = prepared["tiny-llama"], free_port(), free_port()
    output, save = tmp_path / "dataset", tmp_path / "loop"
    env = {k: v for k, v in cpu_engine_env().items() if not k.startswith(("VLLM_", "HSX_")) or k == models.CACHE_DIR_ENV}
    serve = HsxService("serve", ["serve", "--model", str(model), "--draft", str(prepared["tiny-llama-eagle3"]),
                                 "--dtype", "float32", "--max-model-len", "1024", "--enforce-eager",
                                 "--port", str(port), "--health-port", str(health), "--output", str(output),
                                 "--learn", "--save-path", str(save), "--checkpoint-every", "1"],
                       tmp_path, env=env, health=False, ready_path="/health")
    serve.port = port
    answered: list[dict[str, Any]] = []
    logs = output / "logs"
    with serve:
        serve.wait_ready(timeout=600)
        with _traffic(port, model, answered):
            _until(lambda: len(decisions(save / "drafts")) >= 1, "no checkpoint judged")
            trainer = _trainer(serve)
            os.kill(trainer.pid, signal.SIGKILL)
            served_then = len(answered)
            _until(lambda: (logs / "trainer.2.log").exists(), "the trainer was not started again", 60)
            _until(lambda: re.search(r"step (\d+):", (logs / "trainer.2.log").read_text()) is not None,
                   "the restarted trainer never stepped")
            assert len(answered) > served_then  # served on meanwhile
            # The trainer's progress and the gate's decisions on the health port.
            _until(lambda: metric(health, "hsx_serve_trainer_step") >= 1, "no trainer step on /metrics", 60)
            assert metric_sum(health, "hsx_serve_gate_decisions") >= 1
        serve.signal(signal.SIGTERM)
        status = serve.wait(600)
    log = serve.logs()
    assert status == 0, log[-3000:]
    steps_before = [int(n) for n in re.findall(r"step (\d+):", (logs / "trainer.log").read_text())]
    steps_after = [int(n) for n in re.findall(r"step (\d+):", (logs / "trainer.2.log").read_text())]
    assert steps_after[0] > 1 and steps_after[0] <= max(steps_before) + 1, (steps_before, steps_after)  # resumed
    judged = decisions(save / "drafts")
    assert judged and all(d["outcome"] in ("promoted", "kept") for d in judged), judged
    assert re.search(r"trainer restarts\s+1\b", log) and re.search(r"checkpoints judged\s+\d+ promoted", log), log
    versions = {a["kv_transfer_params"]["draft_version"] for a in answered}
    assert versions <= {0} | {d["version"] for d in judged if d["outcome"] == "promoted"}
    sample_ids = [a["kv_transfer_params"]["sample_id"] for a in answered]
    assert sorted(open_dataset(output).request_ids()) == sorted(sample_ids)  # each answered request, once
