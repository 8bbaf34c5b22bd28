"""``hsx serve --draft``: serving with an EAGLE-3 draft and capturing the
verifier's hidden states out of the forward passes that verify it.

The draft is ``tiny-llama-eagle3`` (built from tiny-llama's last layer, so it is
accepted where the verifier repeats itself and rejected elsewhere): every
answer below has accepted and rejected draft tokens, counted by vLLM. Each
response's file and sample hold the states of the tokens it answered with,
equal to HF transformers' forward pass over prompt + answer within 1e-4: a
rejected draft token's state left at any position would differ there, since
the token differs. The greedy answers are HF's own, token for token."""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
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
from hsx.models.tiny_llama_eagle3 import AUX_LAYERS
from hsx.reference import HFReference, max_relative_error

pytestmark = [pytest.mark.integration, pytest.mark.engine]

CAPTURED = [*AUX_LAYERS, 4]  # the draft's aux layers, then tiny-llama's last (4 = num_hidden_layers, pre-norm)
K = 3
TOLERANCE = 1e-4


@dataclass
class Served:
    service: HsxService
    port: int
    model: Path
    files: Path
    dataset: Path

    def complete(self, prompt: list[int] | str, max_tokens: int = 24) -> dict[str, Any]:
        response = httpx.post(f"http://127.0.0.1:{self.port}/v1/completions", timeout=120, json={
            "model": str(self.model), "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True, "kv_transfer_params": {"include_output_tokens": True}})
        assert response.status_code == 200, response.text
        return response.json()  # type: ignore[no-any-return]

    def spec_counter(self, name: str) -> float:
        return metric_sum(self.port, f"vllm:spec_decode_{name}_total")


@pytest.fixture(scope="module")
def served(kafka_bootstrap: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    prepared = models.prepare(names=["tiny-llama", "tiny-llama-eagle3"])
    tmp = tmp_path_factory.mktemp("serve-draft")
    port = free_port()
    service = HsxService("serve", [
        "serve", "--model", str(prepared["tiny-llama"]), "--draft", str(prepared["tiny-llama-eagle3"]),
        "--num-speculative-tokens", str(K), "--dtype", "float32", "--max-model-len", "1024", "--enforce-eager",
        "--port", str(port), "--health-port", str(free_port()), "--shared-storage-path", str(tmp / "files"),
        "--output", str(tmp / "dataset"), "--bootstrap", kafka_bootstrap], tmp, health=False, ready_path="/health")
    service.port = port
    with service:
        service.wait_ready(timeout=600)
        yield Served(service, port, prepared["tiny-llama"], tmp / "files", tmp / "dataset")


def _in_dataset(dataset: Path, sample_ids: set[str], timeout: float = 60) -> Any:
    """The dataset once it holds every one of ``sample_ids``."""
    deadline = time.monotonic() + timeout
    while True:
        opened = open_dataset(dataset)
        held = set(opened.request_ids())
        if sample_ids <= held or time.monotonic() > deadline:
            assert sample_ids <= held, f"not in the dataset: {sorted(sample_ids - held)}"
            return opened
        time.sleep(0.5)


def test_captured_while_speculating_equals_hf_on_what_was_answered(served: Served) -> None:
    prompts: list[list[int] | str] = [[5, 17, 300, 41, 7, 8, 9], list(range(1, 21)), [33] * 5, [454, 990],
                                      "The quick brown fox", list(range(5, 205)),  # crosses the 128-token blocks
                                      [7, 8, 9], "hello"]
    drafted, accepted = served.spec_counter("num_draft_tokens"), served.spec_counter("num_accepted_tokens")
    with ThreadPoolExecutor(len(prompts)) as pool:  # at once: the engine verifies their drafts in shared steps
        responses = list(pool.map(served.complete, prompts))
    drafted = served.spec_counter("num_draft_tokens") - drafted
    accepted = served.spec_counter("num_accepted_tokens") - accepted
    assert 0 < accepted < drafted  # both: accepted draft tokens and rejected ones
    reference = HFReference(served.model)
    for response in responses:
        choice = response["choices"][0]
        prompt, answer = choice["prompt_token_ids"], choice["token_ids"]
        assert answer == reference.greedy(prompt, len(answer))  # the draft changes no answer
        tokens = prompt + answer[:-1]  # the final token was never an input
        file = load_file(response["kv_transfer_params"]["hidden_states_path"])
        assert file["token_ids"].tolist() == tokens
        assert file["hidden_states"].shape == (len(tokens), len(CAPTURED), 128)
        error = max_relative_error(file["hidden_states"], reference.hidden_states(tokens, CAPTURED))
        assert error < TOLERANCE, (prompt, error)
    dataset = _in_dataset(served.dataset, {r["kv_transfer_params"]["sample_id"] for r in responses})
    for response in responses:
        params = response["kv_transfer_params"]
        sample, file = dataset[params["sample_id"]], load_file(params["hidden_states_path"])
        assert sample["token_ids"].tolist() == file["token_ids"].tolist()
        assert torch.equal(sample["hidden_states"], file["hidden_states"])
