"""The seed's server, as its users type it: vLLM's own OpenAI server
(``python -m vllm.entrypoints.openai.api_server``, the CPU wheel's form of
``vllm serve``) with ``HsxConnector`` in place of vLLM's stock hidden-states
connector, the stock connector's ``shared_storage_path``, and hsx's Kafka side
(``"hsx": {"bootstrap": ..., "blocks_topic": ...}``) beside it, with an
``hsx sink`` writing the dataset. Every response names a file with the stock
layout; its tensors equal HF transformers', it is read unchanged by vLLM's own
``load_hidden_states`` and by speculators' online client and ``FileTransfer``;
the response's ``sample_id`` names the same hidden states in the dataset, with
the client's metadata; and nothing a client sends writes outside the storage
root."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from confluent_kafka import Consumer
from datasets import load_from_disk
from safetensors import safe_open
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import load_hidden_states

from hsx import models
from hsx.dataset.reader import open_dataset
from hsx.local.commands import STEADY_SESSION_TIMEOUT_MS, sink_command
from hsx.local.scrape import metric_sum
from hsx.local.spawn import HsxService, cpu_engine_env
from hsx.local.topics import fresh_topics
from hsx.reference import HFReference, max_relative_error
from hsx.runtime.settings import KafkaSettings, TopicSettings
from hsx.schemas import HiddenStatesReady
from tests.integration.test_speculators import SPECULATORS_PY, run_speculators, tiny_train_flags

pytestmark = [pytest.mark.integration, pytest.mark.engine]

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
    kafka: KafkaSettings
    topics: TopicSettings
    dataset: Path

    def complete(self, body: dict[str, Any], request_id: str | None = None) -> dict[str, Any]:
        headers = {"X-Request-Id": request_id} if request_id is not None else {}
        response = httpx.post(f"{self.url}/v1/completions", json={"model": self.model, **body}, headers=headers,
                              timeout=120)
        assert response.status_code == 200, response.text
        return response.json()  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def server(kafka_bootstrap: str, tmp_path_factory: pytest.TempPathFactory) -> Any:
    model = models.prepare(names=["tiny-llama"])["tiny-llama"]
    tmp = tmp_path_factory.mktemp("serve-files")
    storage, dataset = tmp / "hidden_states", tmp / "dataset"
    kafka = KafkaSettings(bootstrap=kafka_bootstrap)
    topics = fresh_topics(kafka, partitions=2)
    speculative = {"method": "extract_hidden_states", "num_speculative_tokens": 1,
                   "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": LAYERS}}}
    extra = {"shared_storage_path": str(storage), "hsx": {"bootstrap": kafka_bootstrap, "blocks_topic": topics.blocks}}
    transfer = {"kv_connector": "HsxConnector", "kv_connector_module_path": "hsx.extractor.connector",
                "kv_role": "kv_producer", "kv_connector_extra_config": extra}
    args = ["--model", str(model), "--host", "127.0.0.1", "--dtype", "float32", "--max-model-len", "1024",
            "--enforce-eager", "--speculative_config", json.dumps(speculative),
            "--kv_transfer_config", json.dumps(transfer)]
    # The CPU environment the docs give for the seed's command.
    env = cpu_engine_env(VLLM_CPU_KVCACHE_SPACE="1", VLLM_CPU_OMP_THREADS_BIND="0-1")
    service = HsxService("api-server", args, tmp, env=env, module="vllm.entrypoints.openai.api_server",
                         port_flag="--port", ready_path="/health")
    sink = HsxService("sink", sink_command(kafka_bootstrap, topics, dataset, "--flush-when-idle", "1",
                                           group=f"g-{topics.blocks}", session_timeout_ms=STEADY_SESSION_TIMEOUT_MS),
                      tmp)
    with service, sink:
        service.wait_ready(timeout=600)
        yield Server(f"http://127.0.0.1:{service.port}", str(model), storage, HFReference(model), service, kafka,
                     topics, dataset)


def _ready(server: Server, sample_ids: set[str], timeout: float = 60) -> dict[str, HiddenStatesReady]:
    """The ready events of ``sample_ids``, once the sink announced them all."""
    consumer = Consumer({"bootstrap.servers": server.kafka.bootstrap, "group.id": f"t-{os.urandom(4).hex()}",
                         "auto.offset.reset": "earliest", "enable.auto.commit": False})
    consumer.subscribe([server.topics.ready])
    found: dict[str, HiddenStatesReady] = {}
    deadline = time.monotonic() + timeout
    try:
        while not sample_ids <= set(found) and time.monotonic() < deadline:
            record = consumer.poll(0.5)
            if record is not None and not record.error():
                event = HiddenStatesReady.model_validate_json(record.value())
                found[event.request_id] = event
    finally:
        consumer.close()
    assert sample_ids <= set(found), f"not announced: {sorted(sample_ids - set(found))}"
    return found


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
    # The seed's configuration (no draft schedule) runs vLLM's method unchanged:
    # a draft token a decode step (hsx's own engines run none).
    assert metric_sum(server.service.port, "vllm:spec_decode_num_draft_tokens_total") > 0


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


def test_each_sample_id_names_the_same_hidden_states_in_the_dataset(server: Server) -> None:
    bodies = [{"prompt": list(range(30, 30 + n)), "max_tokens": 1,
               "kv_transfer_params": {"hsx": {"metadata": {"user": f"u{n}", "n": n}}}} for n in (4, 9, 130)]
    bodies.append({"prompt": [5, 6, 7], "max_tokens": 3, "temperature": 0, "ignore_eos": True,
                   "kv_transfer_params": {"include_output_tokens": True, "hsx": {"capture": "last"}}})
    with ThreadPoolExecutor(len(bodies)) as pool:
        responses = list(pool.map(server.complete, bodies))
    sample_ids = {r["kv_transfer_params"]["sample_id"] for r in responses}
    assert len(sample_ids) == len(bodies)
    ready = _ready(server, sample_ids)
    dataset = open_dataset(server.dataset)
    for body, response in zip(bodies, responses):
        params = response["kv_transfer_params"]
        sample = dataset[params["sample_id"]]
        file = load_hidden_states(params["hidden_states_path"])
        # A last-row sample keeps every token id in the dataset (as the extractor's);
        # its file keeps the one its row belongs to, so that rows and ids align.
        rows = len(file["token_ids"])
        assert torch.equal(sample["token_ids"][-rows:], file["token_ids"])
        assert torch.equal(sample["hidden_states"], file["hidden_states"])
        assert sample["metadata"] == body["kv_transfer_params"]["hsx"].get("metadata", {})
        assert ready[params["sample_id"]].layer_ids == STORED
    *_, last = responses
    assert dataset[last["kv_transfer_params"]["sample_id"]]["hidden_states"].shape[0] == 1
    assert len(dataset[last["kv_transfer_params"]["sample_id"]]["token_ids"]) == 3 + 3 - 1  # prompt + answer[:-1]


def test_bad_metadata_is_refused_in_the_response_and_nothing_is_captured(server: Server) -> None:
    before = _files(server.storage)
    deep: dict[str, Any] = {}
    for _ in range(12):
        deep = {"d": deep}
    for metadata, reason in [(deep, "nested deeper"), ({"big": "x" * 70_000}, "bytes as JSON"), ([1], "dict")]:
        response = server.complete({"prompt": [1, 2], "max_tokens": 1,
                                    "kv_transfer_params": {"hsx": {"metadata": metadata}}})
        params = response["kv_transfer_params"]
        assert set(params) == {"hsx_error"} and reason in params["hsx_error"], params
    assert _files(server.storage) == before
    assert server.service.exited() is None


def test_speculators_online_dataset_generates_every_row_through_the_server(server: Server, tmp_path: Path) -> None:
    rows = [[1, *range(200, 200 + n)] for n in (5, 33)]
    out = tmp_path / "items.safetensors"
    run = subprocess.run([str(SPECULATORS_PY), str(Path(__file__).with_name("speculators_online.py")), server.url,
                          str(tmp_path), json.dumps(rows), str(out)],
                         capture_output=True, text=True, timeout=600, check=False)
    assert run.returncode == 0, run.stderr[-3000:]
    with safe_open(str(out), "pt") as f:
        for i, row in enumerate(rows):
            expected = _expected(server, row)  # [T, 3, H]: aux layers 1, 2, then the verifier's last (4, pre-norm)
            assert f.get_tensor(f"{i}/input_ids").tolist() == row
            assert max_relative_error(f.get_tensor(f"{i}/hidden_states"), expected[:, :-1].flatten(1)) < TOLERANCE
            assert max_relative_error(f.get_tensor(f"{i}/verifier_last_hidden_states"), expected[:, -1]) < TOLERANCE


def test_speculators_train_on_missing_generate_against_the_server(server: Server, tmp_path: Path,
                                                                   cache_dir: Path) -> None:
    """A real ``speculators train`` (through hsx.trainer.speculators_cpu, its CPU
    shim) whose every row's hidden states are missing: each is generated through
    the server, read through FileTransfer, trained on; and lands in the dataset too."""
    flags = tiny_train_flags(tmp_path, cache_dir, layers=[1, 2])  # the server stores 1, 2 and 4 (the verifier's last)
    shutil.rmtree(tmp_path / "export" / "hidden_states")  # nothing cached: every row generated on demand
    flags[flags.index("--on-missing") + 1] = "generate"
    # speculators asks the server for the model it names: the server's (the same tiny-llama, wherever it was built).
    flags[flags.index("--verifier-name-or-path") + 1] = server.model
    rows = [list(r) for r in load_from_disk(str(tmp_path / "export"))["input_ids"]]
    before = set(open_dataset(server.dataset).request_ids()) if (server.dataset / "index").exists() else set()
    run_speculators([str(SPECULATORS_PY), "-m", "hsx.trainer.speculators_cpu", *flags, "--vllm-endpoint",
                     f"{server.url}/v1", "--epochs", "1", "--save-path", str(tmp_path / "trained")], tmp_path)
    assert json.loads((tmp_path / "trained" / "0" / "config.json").read_text())["draft_vocab_size"] == 200
    # Every row served once at least (a validation split or a retry may ask again), each one in the dataset.
    deadline = time.monotonic() + 60
    while True:
        dataset = open_dataset(server.dataset)
        served = [dataset[i]["token_ids"].tolist() for i in set(dataset.request_ids()) - before]
        if all(row in served for row in rows) or time.monotonic() > deadline:
            break
        time.sleep(1)
    assert all(row in served for row in rows), (f"{sum(r in served for r in rows)} of {len(rows)} rows in the dataset "
                                                f"of {len(served)} new samples: {rows[0]} vs {served[:2]}")
