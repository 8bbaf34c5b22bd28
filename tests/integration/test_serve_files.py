"""The seed's server, as its users type it: vLLM's own OpenAI server
(``python -m vllm.entrypoints.openai.api_server``, the CPU wheel's form of
``vllm serve``) with ``HsxConnector`` in place of vLLM's stock hidden-states
connector and only the stock connector's ``shared_storage_path``. Every response
names a file with the stock layout; its tensors equal HF transformers', it is
read unchanged by vLLM's own ``load_hidden_states`` and by speculators' online
client and ``FileTransfer``, and nothing a client sends writes outside the
storage root."""

from __future__ import annotations

import json
import os
import subprocess
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from safetensors import safe_open
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import load_hidden_states

from hsx import models
from hsx.local.spawn import HsxService, cpu_engine_env
from hsx.reference import HFReference, max_relative_error

pytestmark = [pytest.mark.integration, pytest.mark.engine]

ROOT = Path(__file__).resolve().parents[2]
SPECULATORS_PY = ROOT / ".venv-speculators" / "bin" / "python"
LAYERS = [4, 1, 2]  # as a user lists them; vLLM stores them sorted, 4 (= num_hidden_layers) pre-norm
STORED = sorted(LAYERS)
TOLERANCE = 1e-4


@dataclass
class Server:
    url: str
    model: str
    storage: Path
    reference: HFReference
    service: HsxService

    def complete(self, body: dict[str, Any], request_id: str | None = None) -> dict[str, Any]:
        headers = {"X-Request-Id": request_id} if request_id is not None else {}
        response = httpx.post(f"{self.url}/v1/completions", json={"model": self.model, **body}, headers=headers,
                              timeout=120)
        assert response.status_code == 200, response.text
        return response.json()  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Any:
    model = models.prepare(names=["tiny-llama"])["tiny-llama"]
    tmp = tmp_path_factory.mktemp("serve-files")
    storage = tmp / "hidden_states"
    speculative = {"method": "extract_hidden_states", "num_speculative_tokens": 1,
                   "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": LAYERS}}}
    transfer = {"kv_connector": "HsxConnector", "kv_connector_module_path": "hsx.extractor.connector",
                "kv_role": "kv_producer", "kv_connector_extra_config": {"shared_storage_path": str(storage)}}
    args = ["--model", str(model), "--host", "127.0.0.1", "--dtype", "float32", "--max-model-len", "1024",
            "--enforce-eager", "--speculative_config", json.dumps(speculative),
            "--kv_transfer_config", json.dumps(transfer)]
    # The CPU environment the docs give for the seed's command.
    env = cpu_engine_env(VLLM_CPU_KVCACHE_SPACE="1", VLLM_CPU_OMP_THREADS_BIND="0-1")
    service = HsxService("api-server", args, tmp, env=env, module="vllm.entrypoints.openai.api_server",
                         port_flag="--port", ready_path="/health")
    with service:
        service.wait_ready(timeout=600)
        yield Server(f"http://127.0.0.1:{service.port}", str(model), storage, HFReference(model), service)


def _expected(server: Server, token_ids: list[int]) -> torch.Tensor:
    return server.reference.hidden_states(token_ids, STORED)


def _files(root: Path) -> set[Path]:
    return {p for p in root.rglob("*") if p.is_file()} if root.exists() else set()


def test_every_response_names_a_file_equal_to_hf(server: Server) -> None:
    prompts: list[str | list[int]] = ["The quick brown fox jumps over the lazy dog.", [7, 8, 9],
                                      list(range(5, 305)),  # crosses the CPU's 128-token cache blocks
                                      "hello", list(range(40, 60))]
    bodies = [{"prompt": p, "max_tokens": 1, "return_token_ids": True} for p in prompts]
    with ThreadPoolExecutor(len(bodies)) as pool:  # at once: files of one engine step, written side by side
        responses = list(pool.map(server.complete, bodies))
    for response in responses:
        path = response["kv_transfer_params"]["hidden_states_path"]
        assert Path(path).parent == server.storage
        # The lock guards the file from before the response until it is whole.
        assert os.path.exists(path + ".lock") or os.path.exists(path)
        data = load_hidden_states(path)  # vLLM's own reader (LOCK_SH on the lock)
        assert set(data) == {"hidden_states", "token_ids"}
        token_ids = response["choices"][0]["prompt_token_ids"]
        assert data["token_ids"].dtype == torch.int64 and data["token_ids"].tolist() == token_ids
        hidden = data["hidden_states"]
        assert hidden.dtype == torch.float32 and tuple(hidden.shape) == (len(token_ids), len(LAYERS), 128)
        assert max_relative_error(hidden, _expected(server, token_ids)) < TOLERANCE
        with safe_open(path, "pt") as f:
            assert f.keys() == ["hidden_states", "token_ids"]


def test_include_output_tokens_captures_the_answer_but_its_last_token(server: Server) -> None:
    response = server.complete({"prompt": [11, 12, 13, 14], "max_tokens": 6, "temperature": 0, "ignore_eos": True,
                                "return_token_ids": True, "kv_transfer_params": {"include_output_tokens": True}})
    choice = response["choices"][0]
    sequence = choice["prompt_token_ids"] + choice["token_ids"]
    assert len(choice["token_ids"]) == 6
    data = load_hidden_states(response["kv_transfer_params"]["hidden_states_path"])
    assert data["token_ids"].tolist() == sequence[:-1]
    assert max_relative_error(data["hidden_states"], _expected(server, sequence[:-1])) < TOLERANCE


def test_a_request_may_ask_for_its_last_row_or_none(server: Server) -> None:
    last = server.complete({"prompt": [21, 22, 23, 24, 25], "max_tokens": 1,
                            "kv_transfer_params": {"hsx": {"capture": "last"}}})
    data = load_hidden_states(last["kv_transfer_params"]["hidden_states_path"])
    assert data["token_ids"].tolist() == [25]
    assert max_relative_error(data["hidden_states"], _expected(server, [21, 22, 23, 24, 25])[-1:]) < TOLERANCE

    before = _files(server.storage)
    none = server.complete({"prompt": [1, 2, 3], "max_tokens": 1, "kv_transfer_params": {"hsx": {"capture": False}}})
    bad = server.complete({"prompt": [1, 2, 3], "max_tokens": 1, "kv_transfer_params": {"hsx": {"capture": "most"}}})
    assert none["choices"][0]["text"] is not None and not none.get("kv_transfer_params")
    assert bad["kv_transfer_params"] == {"hsx_error": bad["kv_transfer_params"]["hsx_error"]}
    assert "capture" in bad["kv_transfer_params"]["hsx_error"]
    assert _files(server.storage) == before
    assert server.service.exited() is None


@pytest.mark.parametrize("request_id", ["../../escape", "a/b/../../../c", "..", "x" * 10_000, "./.hidden",
                                        "name with spaces", "/etc/passwd"])
def test_hostile_request_ids_and_paths_stay_inside_the_root(server: Server, request_id: str,
                                                            tmp_path: Path) -> None:
    outside = tmp_path / "chosen.safetensors"
    response = server.complete({"prompt": [3, 4, 5], "max_tokens": 1,
                                "kv_transfer_params": {"hidden_states_path": str(outside)}}, request_id=request_id)
    path = Path(response["kv_transfer_params"]["hidden_states_path"])
    assert path.parent == server.storage and len(path.name) < 255
    assert load_hidden_states(str(path))["token_ids"].tolist() == [3, 4, 5]
    assert not outside.exists()
    assert all(p.resolve().is_relative_to(server.storage.resolve()) for p in _files(server.storage))
    assert not list(server.storage.parent.glob("escape*")) and not (server.storage.parent / "c").exists()


def test_speculators_online_client_reads_every_sample_unchanged(server: Server, tmp_path: Path) -> None:
    if not SPECULATORS_PY.exists():
        pytest.fail(f"{SPECULATORS_PY} is missing: run `make speculators`")
    requests = [{"input_ids": [1, *range(100, 100 + n)]} for n in (3, 17, 140)]
    out = tmp_path / "read.safetensors"
    run = subprocess.run([str(SPECULATORS_PY), str(Path(__file__).with_name("speculators_client.py")), server.url,
                          server.model, json.dumps(requests), str(out)],
                         capture_output=True, text=True, timeout=600, check=False)
    assert run.returncode == 0, run.stderr[-3000:]
    with safe_open(str(out), "pt") as f:
        handles = json.loads(f.metadata()["handles"])
        for i, item in enumerate(requests):
            token_ids = f.get_tensor(f"{i}/token_ids")
            assert token_ids.tolist() == item["input_ids"]
            hidden = f.get_tensor(f"{i}/hidden_states")
            assert max_relative_error(hidden, _expected(server, item["input_ids"])) < TOLERANCE
            # FileTransfer deleted the file after reading it, and its lock file on the way.
            assert not Path(handles[str(i)]).exists() and not Path(handles[str(i)] + ".lock").exists()
