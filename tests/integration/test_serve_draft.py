"""``hsx serve --draft``: serving with an EAGLE-3 draft and capturing the
verifier's hidden states out of the forward passes that verify it, and taking
up promoted drafts while it serves from a drafts store on S3 (``--drafts
s3://...``, a real S3 server: what serving pods in Kubernetes follow).

The draft is ``tiny-llama-eagle3`` (built from tiny-llama's last layer, so it is
accepted where the verifier repeats itself and rejected elsewhere): every
answer below has accepted and rejected draft tokens, counted by vLLM. Each
response's file and sample hold the states of the tokens it answered with,
equal to HF transformers' forward pass over prompt + answer within 1e-4: a
rejected draft token's state left at any position would differ there, since
the token differs. The greedy answers are HF's own, token for token.

Then, under load from eight clients, drafts are promoted one after another: a
weaker draft (the same tensors, its MLP zeroed: fewer tokens accepted),
checkpoints that must be refused (NaN, a wrong shape, a truncated file, a
changed embedding that the served draft shares with the verifier), and the
first draft again (a rollback). Every request is answered, with the verifier's
own answer; the swaps show in vLLM's acceptance counts, in each response's
``draft_version`` and in each sample's speculation record."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from safetensors.torch import load_file, save_file

from hsx import models
from hsx.dataset.draft_store import DraftStore, local_copy
from hsx.dataset.reader import open_dataset
from hsx.local.broker import free_port
from hsx.local.s3service import S3Service
from hsx.local.scrape import metric, metric_sum
from hsx.local.spawn import HsxService, cpu_engine_env
from hsx.models.tiny_llama_eagle3 import AUX_LAYERS
from hsx.reference import HFReference, max_relative_error
from hsx.schemas.drafts import PromotedDraft

pytestmark = [pytest.mark.integration, pytest.mark.engine, pytest.mark.faults]

CAPTURED = [*AUX_LAYERS, 4]  # the draft's aux layers, then tiny-llama's last (4 = num_hidden_layers, pre-norm)
K = 3
TOLERANCE = 1e-4
SPECULATORS_PYTHON = Path(__file__).resolve().parents[2] / ".venv-speculators" / "bin" / "python"


@dataclass
class Served:
    service: HsxService
    port: int
    model: Path
    files: Path
    dataset: Path
    draft: Path
    drafts: str
    """The drafts store it follows: ``s3://bucket/prefix``."""
    health_port: int

    def complete(self, prompt: list[int] | str, max_tokens: int = 24) -> dict[str, Any]:
        response = httpx.post(f"http://127.0.0.1:{self.port}/v1/completions", timeout=120, json={
            "model": str(self.model), "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True, "kv_transfer_params": {"include_output_tokens": True}})
        assert response.status_code == 200, response.text
        return response.json()  # type: ignore[no-any-return]

    def spec_counter(self, name: str) -> float:
        return metric_sum(self.port, f"vllm:spec_decode_{name}_total")


@pytest.fixture(scope="module")
def served(kafka_bootstrap: str, tmp_path_factory: pytest.TempPathFactory, s3_server: S3Service,
           s3_bucket: str) -> Iterator[Served]:
    prepared = models.prepare(names=["tiny-llama", "tiny-llama-eagle3"])
    tmp = tmp_path_factory.mktemp("serve-draft")
    port, health_port = free_port(), free_port()
    drafts = f"s3://{s3_bucket}/serve-draft-{tmp.name}"
    service = HsxService("serve", [
        "serve", "--model", str(prepared["tiny-llama"]), "--draft", str(prepared["tiny-llama-eagle3"]),
        "--num-speculative-tokens", str(K), "--dtype", "float32", "--max-model-len", "1024", "--enforce-eager",
        "--port", str(port), "--health-port", str(health_port), "--shared-storage-path", str(tmp / "files"),
        "--output", str(tmp / "dataset"), "--bootstrap", kafka_bootstrap, "--drafts", drafts],
        tmp, env=cpu_engine_env(**s3_server.environ()), health=False, ready_path="/health")
    service.port = port
    with service:
        service.wait_ready(timeout=600)
        yield Served(service, port, prepared["tiny-llama"], tmp / "files", tmp / "dataset",
                     prepared["tiny-llama-eagle3"], drafts, health_port)


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
        # what a draft learns from a served response: its answer, never its prompt
        prompt_tokens = len(response["choices"][0]["prompt_token_ids"])
        assert sample["loss_mask"].tolist() == [i >= prompt_tokens for i in range(len(file["token_ids"]))]


def _variant(draft: Path, to: Path, change: Any) -> Path:
    """A copy of ``draft`` whose tensors ``change`` edits in place (``None``: as they are)."""
    shutil.copytree(draft, to)
    tensors = load_file(to / "model.safetensors")
    if change is not None:
        change(tensors)
    save_file(tensors, str(to / "model.safetensors"))
    return to


def _promote(drafts: str, version: int, path: Path) -> str:
    """What a gate does: the checkpoint uploaded, then the pointer replaced; where it went."""
    return DraftStore(drafts).publish(PromotedDraft(version=version, path=str(path)), path).path


@pytest.mark.usefixtures("s3_env")
def test_promoted_drafts_are_swapped_in_under_load_and_bad_ones_refused(served: Served, tmp_path: Path) -> None:
    def weaker(t: dict[str, torch.Tensor]) -> None:  # blind to the verifier's states: proposes one token always
        t["fc.weight"].zero_()

    def nan(t: dict[str, torch.Tensor]) -> None:
        t["fc.weight"][0, 0] = float("nan")

    def shape(t: dict[str, torch.Tensor]) -> None:
        t["lm_head.weight"] = t["lm_head.weight"][:-1].clone()

    def embedding(t: dict[str, torch.Tensor]) -> None:
        t["embed_tokens.weight"] += 1

    weak = _variant(served.draft, tmp_path / "weak", weaker)
    bad = {"NaN": _variant(served.draft, tmp_path / "nan", nan),
           "shapes": _variant(served.draft, tmp_path / "shape", shape),
           "does not load": _variant(served.draft, tmp_path / "truncated", None),
           "shares with it": _variant(served.draft, tmp_path / "embedding", embedding)}
    weights = bad["does not load"] / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    prompts = [[5, 17, 300, 41, n] for n in range(8)]
    answered: list[dict[str, Any]] = []
    failed: list[str] = []
    stop = threading.Event()

    per_client: list[list[int]] = [[] for _ in prompts]

    def client(n: int) -> None:
        while not stop.is_set():
            try:
                response = served.complete(prompts[n], max_tokens=16)
                answered.append(response)
                per_client[n].append(response["kv_transfer_params"]["draft_version"])
            except (AssertionError, httpx.HTTPError) as exc:
                failed.append(f"{type(exc).__name__}: {exc}")
                return

    def count(version: int) -> int:
        return sum(1 for a in answered if a["kv_transfer_params"]["draft_version"] == version)

    def serving(version: int, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while metric(served.health_port, "hsx_serve_draft_version") != version:
            assert time.monotonic() < deadline, f"draft {version} never served"
            time.sleep(0.2)

    def answered_by(version: int, least: int, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while count(version) < least:
            assert time.monotonic() < deadline and not failed, (failed, count(version))
            time.sleep(0.2)

    clients = [threading.Thread(target=client, args=(n,)) for n in range(8)]
    for thread in clients:
        thread.start()
    acceptance = {}
    try:
        window = _Window(served)
        answered_by(0, 16)
        acceptance[0] = window.acceptance()
        _promote(served.drafts, 1, weak)
        serving(1)
        window = _Window(served)
        answered_by(1, count(1) + 16)
        acceptance[1] = window.acceptance()
        for version, path in enumerate(bad.values(), start=2):
            _promote(served.drafts, version, path)
            _refused(served, version)
        _promote(served.drafts, 6, served.draft)  # the rollback
        serving(6)
        window = _Window(served)
        answered_by(6, count(6) + 16)
        acceptance[6] = window.acceptance()
    finally:
        stop.set()
        for thread in clients:
            thread.join(120)
    assert not failed
    log = served.service.logs()
    for version, reason in enumerate(bad, start=2):
        where = re.escape(f"{served.drafts}/v{version}")
        assert re.search(rf"draft {version} \({where}\) refused.*{reason}", log), (reason, log[-3000:])
    versions = [a["kv_transfer_params"]["draft_version"] for a in answered]
    assert set(versions) == {0, 1, 6}  # never a refused one
    for seen in per_client:  # each client's answers in order: a version once left never comes back
        assert seen == sorted(seen, key=[0, 1, 6].index), seen
    reference = HFReference(served.model)
    for prompt in prompts:  # the verifier's own answers throughout, whatever the draft
        expected = reference.greedy(prompt, 16)
        assert all(a["choices"][0]["token_ids"] == expected for a in answered
                   if a["choices"][0]["prompt_token_ids"] == prompt)
    # The weaker draft shows in vLLM's counts; the rollback restores them.
    assert acceptance[1] < acceptance[0] - 0.3 and acceptance[6] > acceptance[1] + 0.3, acceptance
    dataset = _in_dataset(served.dataset, {a["kv_transfer_params"]["sample_id"] for a in answered})
    for response in answered[::7]:
        params = response["kv_transfer_params"]
        event = dataset.event(params["sample_id"])
        assert event.speculation is not None and event.speculation.draft_version == params["draft_version"]
        assert len(event.speculation.accepted_per_position) == K


class _Window:
    """vLLM's spec-decode counters from now on."""

    def __init__(self, served: Served) -> None:
        self._served = served
        self._start = self._read()

    def _read(self) -> tuple[float, float]:
        return self._served.spec_counter("num_drafts"), self._served.spec_counter("num_accepted_tokens")

    def acceptance(self) -> float:
        """Mean acceptance length since the window opened."""
        (drafts, accepted), (drafts0, accepted0) = self._read(), self._start
        assert drafts > drafts0
        return 1 + (accepted - accepted0) / (drafts - drafts0)


def _refused(served: Served, version: int, timeout: float = 60) -> None:
    """Once hsx serve logged ``version`` refused."""
    deadline = time.monotonic() + timeout
    while not re.search(rf"draft {version} \(.*\) refused", served.service.logs()):
        assert time.monotonic() < deadline, f"draft {version} neither refused nor served"
        time.sleep(0.2)


GATE = """
import json, sys, torch
from pathlib import Path
from hsx.trainer.gate import Gate
drafts, initial, dataset, verifier, *checkpoints = sys.argv[1:]
gate = Gate(drafts, Path(initial), dataset, Path(verifier), share=1.0, samples=48, margin=0.2,
            layers=[1, 2, 3], total_seq_len=1024, dtype=torch.float32)
for checkpoint in checkpoints:
    d = gate.judge(Path(checkpoint))
    print(json.dumps({"outcome": d.outcome, "reason": d.reason, "version": d.version,
                      "candidate": d.candidate and d.candidate.acceptance_length,
                      "served": d.served and d.served.acceptance_length}))
"""


@pytest.mark.usefixtures("s3_env")
def test_the_gate_promotes_a_better_draft_refuses_a_bad_one_and_the_server_takes_it_up(
        served: Served, tmp_path: Path) -> None:
    """The loop without its training: served samples (from the tests before),
    the gate's teacher-forced score from them, the server's swap. The gate's
    score orders the drafts as vLLM's counts do."""
    base = DraftStore(served.drafts).promoted()
    version = base.version + 1 if base is not None else 1
    weak = _variant(served.draft, tmp_path / "weak", lambda t: t["fc.weight"].zero_())
    _promote(served.drafts, version, weak)
    _wait_serving(served, version)
    measured = {"weak": _measured(served)}
    better = _variant(served.draft, tmp_path / "better", None)
    broken = _variant(served.draft, tmp_path / "broken", lambda t: t["fc.weight"].fill_(float("inf")))
    run = subprocess.run([str(SPECULATORS_PYTHON), "-c", GATE, str(served.drafts), str(served.draft),
                          str(served.dataset), str(served.model), str(broken), str(better)],
                         capture_output=True, text=True, timeout=600, check=False)
    assert run.returncode == 0, run.stderr[-3000:]
    refused, promoted = (json.loads(line) for line in run.stdout.strip().splitlines()[-2:])
    assert refused["outcome"] == "refused" and "NaN or inf" in refused["reason"], refused
    assert promoted["outcome"] == "promoted" and promoted["version"] == version + 1, promoted
    assert promoted["candidate"] > promoted["served"] + 0.2, promoted  # scored on the served samples
    published = DraftStore(served.drafts).promoted()
    assert published is not None and published.path == f"{served.drafts}/v{version + 1}"
    copy = local_copy(published.path, tmp_path / "downloaded")  # what the servers load: the checkpoint's bytes
    drafted = [better / "config.json", *sorted(better.glob("*.safetensors"))]
    assert sorted(f.name for f in copy.iterdir()) == sorted(f.name for f in drafted)
    assert all((copy / f.name).read_bytes() == f.read_bytes() for f in drafted)
    _wait_serving(served, version + 1)
    measured["better"] = _measured(served)
    assert measured["better"] > measured["weak"] + 0.2, measured  # vLLM's counts order them as the gate did


def _wait_serving(served: Served, version: int, timeout: float = 60) -> None:
    """Requests until ``version`` serves them: an idle engine runs no step, so it
    takes a promoted draft up with the next traffic."""
    deadline = time.monotonic() + timeout
    while metric(served.health_port, "hsx_serve_draft_version") != version:
        assert time.monotonic() < deadline, f"draft {version} never served"
        served.complete([5, 17, 300], max_tokens=4)


def _measured(served: Served) -> float:
    """vLLM's mean acceptance length over a burst of eight greedy requests."""
    window = _Window(served)
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(served.complete, [[5, 17, 300, 41, 100 + n] for n in range(8)]))
    return window.acceptance()


@pytest.mark.usefixtures("s3_env")
def test_train_draft_warm_starts_from_the_served_draft_and_judges_each_checkpoint(served: Served,
                                                                                 tmp_path: Path) -> None:
    """``hsx train-draft --init-from --promote-to`` on the served traffic's ready
    events: half the samples kept out by hash, each checkpoint judged on them
    against the draft the server serves, the decision recorded with both scores."""
    from hsx.trainer.gate import decisions

    announced = re.search(r"samples announced on (\S+) at (\S+);", served.service.logs())
    assert announced is not None
    before = len(decisions(served.drafts))
    run = subprocess.run([
        str(SPECULATORS_PYTHON.with_name("hsx")), "train-draft", "--bootstrap", announced.group(2),
        "--ready-topic", announced.group(1), "--group", f"loop-{tmp_path.name}", "--dataset", str(served.dataset),
        "--model", str(served.model), "--save-path", str(tmp_path / "trained"), "--init-from", str(served.draft),
        "--promote-to", served.drafts, "--holdout", "0.5", "--gate-samples", "16", "--steps", "2",
        "--checkpoint-every", "2", "--total-seq-len", "256", "--hidden-states-dtype", "float32",
        "--num-workers", "0", "--exit-when-idle", "5", "--lr", "1e-4"],
        capture_output=True, text=True, timeout=600, check=False)
    assert run.returncode == 0, run.stderr[-3000:]
    (decision,) = decisions(served.drafts)[before:]
    assert decision["checkpoint"] == str(tmp_path / "trained" / "0")
    assert decision["outcome"] in ("promoted", "kept"), decision
    assert decision["candidate"]["positions"] == decision["served"]["positions"] > 0
    assert 1 <= decision["candidate"]["acceptance_length"] <= 1 + K
