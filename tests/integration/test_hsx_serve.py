"""``hsx serve`` as a user runs it: one command, a file per response and the
dataset, and what it promises when it ends.

* Serving with an EAGLE-3 draft, a full disk for the files, then kill -9 of
  vLLM's server under load (a lost engine): the server answers on while files
  cannot be written; no partial file under a final name; every answered
  request's file and sample complete and equal, or named lost in hsx serve's log
  (and counted in its summary), never silently missing; the dataset holds each
  sample once, prompt and answer, no rejected draft token's state (HF's).
* A broker that stops answering for a while, then SIGTERM with requests in
  flight, on the same directory: the server keeps answering and its ``/readyz``
  says Kafka is behind; the files the killed engine promised and never wrote are
  counted as the earlier server's; every answered request's hidden states are in
  the dataset exactly once (a request arriving during the drain is answered
  "abort" by vLLM, promised nothing and captured nothing), equal to its file and
  to HF transformers', the summary counts them, and the command exits 0. hsx's
  own metrics count the captures beside vLLM's, whose show that no decode step
  ran a draft token.

Both tests run on one module's directories, in this order (the engine tests run
on one worker, in file order); the files' is a tmpfs (root, as on the CI
machines), to be filled."""

from __future__ import annotations

import os
import re
import signal
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
import torch
from safetensors.torch import load_file

from hsx import models
from hsx.dataset.reader import open_dataset
from hsx.local.broker import EmbeddedBroker, free_port
from hsx.local.scrape import get, metric_sum
from hsx.local.spawn import HsxService
from hsx.models.tiny_llama_eagle3 import AUX_LAYERS
from hsx.reference import HFReference, max_relative_error
from hsx.runtime.settings import KafkaSettings
from hsx.schemas import HiddenStatesReady
from hsx.serving.reports import STALL_SECONDS
from tests.drain import drain
from tests.mounts import tmpfs

pytestmark = [pytest.mark.integration, pytest.mark.engine, pytest.mark.faults]

LAYERS = [1, 3, 4]
CAPTURED = [*AUX_LAYERS, 4]
"""What serving with the draft captures: its aux layers, then tiny-llama's last."""


@pytest.fixture(scope="module")
def model() -> Path:
    return models.prepare(names=["tiny-llama"])["tiny-llama"]


@pytest.fixture(scope="module")
def draft() -> Path:
    return models.prepare(names=["tiny-llama-eagle3"])["tiny-llama-eagle3"]


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """One directory both servers write their files in, as a restarted pod's
    volume: a file system of its own, to fill."""
    with tmpfs(tmp_path_factory.mktemp("served-files"), "size=32m") as mount:
        yield mount


@contextmanager
def _full(directory: Path) -> Iterator[None]:
    """``directory``'s file system full until the block ends."""
    filler = directory / "filler"
    with filler.open("wb") as out:
        with suppress(OSError):  # ENOSPC: full
            while True:
                out.write(bytes(1 << 20))
                out.flush()
    try:
        yield
    finally:
        filler.unlink()


def _serve(model: Path, files: Path, output: Path, bootstrap: str, logs: Path, captures: list[str]) -> HsxService:
    """``hsx serve`` capturing as ``captures`` says (``--layers`` or ``--draft``)."""
    port = free_port()
    serve = HsxService("serve", ["serve", "--model", str(model), "--dtype", "float32", "--max-model-len", "1024",
                                 "--enforce-eager", *captures, "--port", str(port),
                                 "--health-port", str(free_port()), "--shared-storage-path", str(files),
                                 "--output", str(output), "--bootstrap", bootstrap], logs, health=False,
                       ready_path="/health")
    serve.port = port
    return serve


@contextmanager
def _load(serve: HsxService, model: Path, answered: list[dict[str, Any]],
          rejected: list[dict[str, Any]], max_tokens: int = 2) -> Iterator[None]:
    """Four clients sending completions until the block ends; within it, at least
    eight answered before it is entered. A request arriving during a drain is
    answered "abort" by vLLM: kept apart, in ``rejected``."""
    url = f"http://127.0.0.1:{serve.port}/v1/completions"
    stop = threading.Event()

    def client(n: int) -> None:
        deadline = time.monotonic() + 120  # bounded whatever happens to the test's thread
        while not stop.is_set() and time.monotonic() < deadline:
            prompt = [1, *range(100 + n, 100 + n + 20 + 7 * n)]
            try:
                response = httpx.post(url, json={"model": str(model), "prompt": prompt, "max_tokens": max_tokens,
                                                 "return_token_ids": True}, timeout=15)
            except httpx.HTTPError:
                return  # the server stopped taking requests (or is gone)
            if response.status_code != 200:
                return
            body = response.json()
            (rejected if body["choices"][0]["finish_reason"] == "abort" else answered).append(body)

    with ThreadPoolExecutor(4) as pool:
        for n in range(4):
            pool.submit(client, n)
        try:
            deadline = time.monotonic() + 60
            while len(answered) < 8 and time.monotonic() < deadline:  # load first, then the fault
                time.sleep(0.2)
            yield
        finally:
            stop.set()


def test_a_full_disk_then_kill_9_of_the_engine_under_load_lose_only_what_is_named(model: Path, draft: Path,
                                                                                  files: Path, kafka_bootstrap: str,
                                                                                  tmp_path: Path) -> None:
    output = tmp_path / "dataset"
    serve = _serve(model, files, output, kafka_bootstrap, tmp_path, ["--draft", str(draft)])
    answered: list[dict[str, Any]] = []
    rejected: list[dict[str, Any]] = []
    with serve:
        serve.wait_ready(timeout=600)
        with _load(serve, model, answered, rejected, max_tokens=8), _full(files):
            before = len(answered)
            deadline = time.monotonic() + 60
            while len(answered) < before + 4 and time.monotonic() < deadline:
                time.sleep(0.2)
            answered_while_full = len(answered) - before
            (server,) = [p for p in psutil.Process(serve.pid).children()
                         if "vllm.entrypoints.openai.api_server" in " ".join(p.cmdline())]
            os.killpg(os.getpgid(server.pid), signal.SIGKILL)  # the engine and its workers, no warning
        status = serve.wait(300)
    log = serve.logs()
    assert status == 1 and "vLLM's server exited with -9" in log, log[-3000:]
    assert len(answered) >= 8 and answered_while_full >= 4 and not rejected  # it answered on while the disk was full
    not_written = re.findall(r"file (\S+) lost: .*No space left on device", log)
    assert not_written, log[-3000:]  # each named, with the reason
    lost_files = set(_listed(log, "files promised, never written")) | set(not_written)
    lost_samples = set(_listed(log, "samples promised, never acknowledged"))
    assert _count(_row(log, "files lost")) == len(lost_files)  # counted as named
    assert _count(_row(log, "samples lost")) == len(lost_samples)
    assert not _listed(log, "samples acknowledged, never announced")  # the sink outlived the engine
    dataset = open_dataset(output)
    in_dataset = dataset.request_ids()
    assert len(set(in_dataset)) == len(in_dataset) == int(_row(log, "samples captured").split()[0].replace(",", ""))
    reference, checked = HFReference(model), 0
    for response in answered:
        choice = response["choices"][0]
        params, token_ids = response["kv_transfer_params"], choice["prompt_token_ids"] + choice["token_ids"][:-1]
        path, sample_id = params["hidden_states_path"], params["sample_id"]
        file = None if path in lost_files else load_file(path)  # a whole file, or none under its name
        assert (file is None) == (not os.path.exists(path)), path
        assert (sample_id in lost_samples) != (sample_id in in_dataset), sample_id
        if file is not None:
            assert file["token_ids"].tolist() == token_ids
        if sample_id in in_dataset:
            sample = dataset[sample_id]
            assert sample["token_ids"].tolist() == token_ids
            if file is not None:
                assert torch.equal(sample["hidden_states"], file["hidden_states"])
            if checked < 6:  # the answer's states are the verifier's own: no rejected draft token's
                assert max_relative_error(sample["hidden_states"], reference.hidden_states(token_ids, CAPTURED)) < 1e-4
                checked += 1
    assert checked
    for path in files.glob("*.safetensors"):
        load_file(path)  # no partial file under a final name, answered or not


def test_a_silent_broker_then_sigterm_leave_every_answered_request_in_the_dataset_once(model: Path, files: Path,
                                                                                       tmp_path: Path) -> None:
    output = tmp_path / "dataset"
    orphans = [lock for lock in files.glob("*.safetensors.lock") if not lock.with_suffix("").exists()]
    answered: list[dict[str, Any]] = []
    rejected: list[dict[str, Any]] = []
    with EmbeddedBroker() as broker:  # its own, to stop answering
        serve = _serve(model, files, output, broker.bootstrap, tmp_path, ["--layers", ",".join(map(str, LAYERS))])
        with serve:
            serve.wait_ready(timeout=600)
            with _load(serve, model, answered, rejected):
                scraped = metric_sum(serve_health_port(serve), "hsx_serve_captures_total")
                generated, drafted = (metric_sum(serve.port, f"vllm:{name}_total")
                                      for name in ("generation_tokens", "spec_decode_num_draft_tokens"))
                os.kill(broker.pid, signal.SIGSTOP)
                try:
                    before, said = len(answered), _readiness_within(serve, STALL_SECONDS + 15, "Kafka behind")
                    served_meanwhile = len(answered) - before
                finally:
                    os.kill(broker.pid, signal.SIGCONT)
                serve.signal(signal.SIGTERM)  # its own group: vLLM's server and the sink get it from hsx serve
            status = serve.wait(300)
        log = serve.logs()
        assert status == 0, log[-3000:]
        # The topic hsx serve printed is where a trainer finds every answered request's sample.
        announced = re.search(r"samples announced on (\S+) at (\S+);", log)
        assert announced is not None and announced.group(2) == broker.bootstrap, log[:3000]
        events = [HiddenStatesReady.model_validate_json(r.value()) for r in drain(
            KafkaSettings(bootstrap=broker.bootstrap), announced.group(1), expected=len(answered), timeout=30)]
    assert len(answered) > 4 and scraped > 0  # hsx's metrics counted captures while serving
    assert generated > 0 and drafted == 0  # decode steps ran no draft token (hsx.extractor.no_draft_tokens)
    assert "Kafka behind" in said and served_meanwhile > 0, said  # answering while Kafka was silent, and said so
    assert all(r["kv_transfer_params"] is None for r in rejected)  # never scheduled: nothing promised
    if orphans:  # what the killed engine promised and never wrote: its loss, counted here, locks removed
        assert _row(log, "files an earlier server lost").startswith(f"{len(orphans):,} ")
        assert not any(lock.exists() for lock in orphans)
    assert not list(files.glob(".*.tmp"))  # no write was cut off half way, nor left by the kill
    dataset = open_dataset(output)
    sample_ids = [a["kv_transfer_params"]["sample_id"] for a in answered]
    assert len(set(sample_ids)) == len(sample_ids)
    assert sorted(dataset.request_ids()) == sorted(sample_ids)  # every answered request once, no other
    assert {e.request_id for e in events} == set(sample_ids)  # (a re-announcement would repeat one)
    reference = HFReference(model)
    for response in answered[:: max(1, len(answered) // 6)]:
        params = response["kv_transfer_params"]
        sample, file = dataset[params["sample_id"]], load_file(params["hidden_states_path"])
        token_ids = response["choices"][0]["prompt_token_ids"]
        assert sample["token_ids"].tolist() == file["token_ids"].tolist() == token_ids
        assert torch.equal(sample["hidden_states"], file["hidden_states"])
        assert max_relative_error(file["hidden_states"], reference.hidden_states(token_ids, LAYERS)) < 1e-4
    assert _row(log, "samples captured").startswith(f"{len(answered):,} ")
    assert _row(log, "samples lost") == "0" and _row(log, "files lost") == "0"
    assert _row(log, "samples not announced") == "0" and _row(log, "samples dead-lettered") == "0"


def _readiness_within(serve: HsxService, seconds: float, expected: str) -> str:
    """hsx serve's ``/readyz`` body once it says ``expected`` (or after ``seconds``)."""
    deadline = time.monotonic() + seconds
    said = ""
    while expected not in said and time.monotonic() < deadline:
        status, body = get(serve_health_port(serve), "/readyz")
        said = f"{status} {body}"
        time.sleep(0.5)
    return said


def _count(value: str) -> int:
    """The number a summary row starts with (``4: OSError ...``, ``1 (1 promised ...)``)."""
    match = re.match(r"[\d,]+", value)
    assert match is not None, value
    return int(match.group().replace(",", ""))


def _listed(log: str, what: str) -> list[str]:
    """The ids hsx serve named on its ``what`` line (none when it has no such line)."""
    match = re.search(rf"^hsx serve: {re.escape(what)}[^:]*: (.+)$", log, re.MULTILINE)
    return match.group(1).split(", ") if match else []


def serve_health_port(serve: HsxService) -> int:
    return int(serve.args[serve.args.index("--health-port") + 1])


def _row(log: str, name: str) -> str:
    """A value of the summary table ``hsx serve`` printed."""
    for line in log.splitlines():
        if line.startswith(f"  {name} "):
            return line[len(name) + 2:].strip()
    raise AssertionError(f"no summary row {name!r} in:\n{log[-2000:]}")


def test_a_missing_destination_is_a_usage_error(model: Path, tmp_path: Path) -> None:
    run = HsxService("serve-usage", ["serve", "--model", str(model)], tmp_path, health=False).start()
    assert run.wait(60) == 2
    assert "give --shared-storage-path DIR (a file per response), --output DATASET, or both" in run.logs()
