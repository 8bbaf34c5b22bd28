"""``hsx serve`` as a user runs it: one command, a file per response and the
dataset. SIGTERM with requests in flight: every answered request's hidden states
are in the dataset exactly once (a request arriving during the drain is answered
"abort" by vLLM, promised nothing and captured nothing), equal to its file and to HF transformers', the
summary counts them, and the command exits 0. hsx's own metrics count the
captures beside vLLM's."""

from __future__ import annotations

import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from safetensors.torch import load_file

from hsx import models
from hsx.dataset.reader import open_dataset
from hsx.local.broker import free_port
from hsx.local.scrape import metric_sum
from hsx.local.spawn import HsxService
from hsx.reference import HFReference, max_relative_error

pytestmark = [pytest.mark.integration, pytest.mark.engine]

LAYERS = [1, 3, 4]


def test_sigterm_under_load_leaves_every_answered_request_in_the_dataset_once(kafka_bootstrap: str,
                                                                               tmp_path: Path) -> None:
    model = models.prepare(names=["tiny-llama"])["tiny-llama"]
    files, output = tmp_path / "files", tmp_path / "dataset"
    port = free_port()
    serve = HsxService("serve", ["serve", "--model", str(model), "--dtype", "float32", "--max-model-len", "1024",
                                 "--enforce-eager", "--layers", ",".join(map(str, LAYERS)), "--port", str(port),
                                 "--health-port", str(free_port()), "--shared-storage-path", str(files),
                                 "--output", str(output), "--bootstrap", kafka_bootstrap], tmp_path, health=False,
                       ready_path="/health")
    serve.port = port
    url = f"http://127.0.0.1:{port}/v1/completions"
    with serve:
        serve.wait_ready(timeout=600)
        answered: list[dict[str, Any]] = []
        rejected: list[dict[str, Any]] = []  # arrived during the drain: vLLM answers them "abort"
        stop = threading.Event()

        def client(n: int) -> None:
            deadline = time.monotonic() + 120  # bounded whatever happens to the test's thread
            while not stop.is_set() and time.monotonic() < deadline:
                prompt = [1, *range(100 + n, 100 + n + 20 + 7 * n)]
                try:
                    response = httpx.post(url, json={"model": str(model), "prompt": prompt, "max_tokens": 2,
                                                     "return_token_ids": True}, timeout=60)
                except httpx.HTTPError:
                    return  # the server stopped taking requests
                if response.status_code != 200:
                    return
                body = response.json()
                (rejected if body["choices"][0]["finish_reason"] == "abort" else answered).append(body)

        with ThreadPoolExecutor(4) as pool:
            for n in range(4):
                pool.submit(client, n)
            try:
                deadline = time.monotonic() + 60
                while len(answered) < 8 and time.monotonic() < deadline:  # load first, then the signal
                    time.sleep(0.2)
                scraped = metric_sum(serve_health_port(serve), "hsx_serve_captures_total")
                serve.signal(signal.SIGTERM)  # hsx serve's own group: vLLM's server and the sink get it from hsx serve
            finally:
                stop.set()
        status = serve.wait(300)
    log = serve.logs()
    assert status == 0, log[-3000:]
    assert len(answered) > 4 and scraped > 0  # hsx's metrics counted captures while serving
    assert all(r["kv_transfer_params"] is None for r in rejected)  # never scheduled: nothing promised
    dataset = open_dataset(output)
    sample_ids = [a["kv_transfer_params"]["sample_id"] for a in answered]
    assert len(set(sample_ids)) == len(sample_ids)
    assert sorted(dataset.request_ids()) == sorted(sample_ids)  # every answered request once, no other
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
    assert not list(files.glob(".*.tmp"))  # no write was cut off half way


def serve_health_port(serve: HsxService) -> int:
    return int(serve.args[serve.args.index("--health-port") + 1])


def _row(log: str, name: str) -> str:
    """A value of the summary table ``hsx serve`` printed."""
    for line in log.splitlines():
        if line.startswith(f"  {name} "):
            return line[len(name) + 2:].strip()
    raise AssertionError(f"no summary row {name!r} in:\n{log[-2000:]}")


def test_a_missing_destination_is_a_usage_error(tmp_path: Path) -> None:
    model = models.prepare(names=["tiny-llama"])["tiny-llama"]
    run = HsxService("serve-usage", ["serve", "--model", str(model)], tmp_path, health=False).start()
    assert run.wait(60) == 2
    assert "give --shared-storage-path DIR (a file per response), --output DATASET, or both" in run.logs()
