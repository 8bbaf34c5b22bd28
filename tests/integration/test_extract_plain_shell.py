"""``hsx extract`` from a plain shell: no ``VLLM_*`` or ``HSX_*`` variables (the
Makefile no longer exports any), so the extractor picks the CPU engine's KV cache
and thread binding itself (a share of the cores per rank of a tensor-parallel
engine), keeps what the user set, and says in one line what to change when memory
or cores are too few; Intel's OpenMP runtime reaches the engine's worker."""

from __future__ import annotations

import json
import os
from collections import Counter
from pathlib import Path

import pytest

from hsx import models
from hsx.extractor.cpu_defaults import BIND_ENV, KV_ENV, PRELOAD_ENV, cpu_list, intel_openmp, rank_binding
from hsx.extractor.engine import default_layer_ids
from hsx.local.commands import STEADY_SESSION_TIMEOUT_MS, extract_command
from hsx.local.spawn import HsxService, cpu_engine_env
from hsx.local.topics import fresh_topics
from tests.drain import drain
from hsx.runtime.settings import KafkaSettings, TopicSettings
from hsx.schemas import BlockRecordHeaders
from hsx.reference import HFReference, max_relative_error
from tests.engine_helpers import reassemble
from tests.reliability.harness import as_records, publish

pytestmark = pytest.mark.integration

PROMPTS = [{"request_id": f"plain-{i}", "token_ids": [(i * 31 + k * 17) % 400 + 3 for k in range(n)]}
           for i, n in enumerate([3, 40, 150, 7, 90])]


def plain_shell_env(bootstrap: str, **extra: str) -> dict[str, str]:
    """A user's shell: this environment without any ``VLLM_*`` or ``HSX_*``
    variable but the broker's address, and without the ``LD_PRELOAD`` an engine
    started in this process left in it."""
    env = {k: v for k, v in cpu_engine_env().items() if not k.startswith(("VLLM_", "HSX_")) and k != PRELOAD_ENV}
    return {**env, "HSX_KAFKA_BOOTSTRAP": bootstrap, **extra}


def extract(kafka: KafkaSettings, topics: TopicSettings, log_dir: Path, name: str, *extra: str,
            env: dict[str, str], model: str | Path = "tiny-llama") -> tuple[int, str]:
    """``hsx extract`` on a tiny model (a name, or a directory) until idle: its exit status and log."""
    tiny = model if isinstance(model, Path) else models.prepare(names=[model])[model]
    command = extract_command(kafka.bootstrap, topics, tiny, "--exit-when-idle", "5", *extra,
                              group=f"g-{topics.prompts}", session_timeout_ms=STEADY_SESSION_TIMEOUT_MS)
    with HsxService(name, command, log_dir, env=env) as extractor:
        return extractor.wait(900), extractor.logs()


@pytest.mark.engine
def test_extract_runs_without_any_vllm_variable(kafka: KafkaSettings, tmp_path: Path) -> None:
    topics = fresh_topics(kafka, partitions=1)
    publish(kafka, topics.prompts, as_records(PROMPTS))

    status, log = extract(kafka, topics, tmp_path, "plain", "--max-model-len", "512",
                          env=plain_shell_env(kafka.bootstrap))
    assert status == 0, log[-5000:]
    bind = cpu_list(os.sched_getaffinity(0))
    assert f"CPU engine: {KV_ENV}=1 (GiB) for 128 × 512 tokens, {BIND_ENV}={bind}" in log
    assert "Explicitly set (1.0/" in log  # vLLM's worker used it
    if intel_openmp():  # x86-64 Linux: the worker checks its own LD_PRELOAD
        assert f"{PRELOAD_ENV}={intel_openmp()} (Intel OpenMP)" in log
        assert "libiomp is not found in LD_PRELOAD" not in log  # (tcmalloc: not installed here)
    samples = reassemble(drain(kafka, topics.blocks, expected=1, timeout=30, settle=3.0))
    assert {k: len(v) for k, v in samples.items()} == {p["request_id"]: 1 for p in PROMPTS}


def _one_line_usage_error(status: int, log: str) -> str:
    """The ``hsx extract:`` error line of a run that stopped before vLLM started."""
    assert status == 2, log[-3000:]
    assert "Traceback" not in log
    (line,) = [line for line in log.splitlines() if "hsx extract: " in line]
    return line


def test_a_users_cache_size_is_kept_and_checked(kafka: KafkaSettings, tmp_path: Path) -> None:
    env = plain_shell_env(kafka.bootstrap, **{KV_ENV: "100000"})
    status, log = extract(kafka, fresh_topics(kafka, partitions=1), tmp_path, "too-big", env=env)
    assert f"{KV_ENV}=100000 GiB is more than the" in _one_line_usage_error(status, log)


def test_a_max_model_len_no_memory_holds_is_one_line(kafka: KafkaSettings, tmp_path: Path) -> None:
    # The tiny model with a context of 10**9 tokens (its config only; the weights are linked),
    # so the length passes the context check and meets the memory check.
    tiny = models.prepare(names=["tiny-llama"])["tiny-llama"]
    long_context = tmp_path / "tiny-long-context"
    long_context.mkdir()
    for path in tiny.iterdir():
        if path.name != "config.json":
            (long_context / path.name).symlink_to(path)
    config = json.loads((tiny / "config.json").read_text())
    (long_context / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 10**9}))
    status, log = extract(kafka, fresh_topics(kafka, partitions=1), tmp_path, "too-long",
                          "--max-model-len", str(10**9), env=plain_shell_env(kafka.bootstrap), model=long_context)
    line = _one_line_usage_error(status, log)
    assert "--max-model-len 1000000000" in line and KV_ENV in line


TWO_RANK_PROMPTS = [*PROMPTS[:3], {"request_id": "plain-answer", "token_ids": list(range(10, 40)),
                             "generation": {"max_tokens": 8, "ignore_eos": True}}]


@pytest.mark.engine
@pytest.mark.parametrize("layout", ["--tensor-parallel-size", "--data-parallel-size"], ids=["tp2", "dp2"])
def test_two_ranks_run_from_a_plain_shell_and_each_prompt_is_sent_once(kafka: KafkaSettings, tmp_path: Path,
                                                                        layout: str) -> None:
    """Two ranks, each bound to cores of its own. Tensor parallel: every rank
    holds the same hidden states and only rank 0 produces them. Data parallel:
    two engine cores share the prompts (vLLM balances them), each with its own
    connector, each sending its own. Either way no record goes out twice (a
    second rank sending), one attempt and one sample per prompt (a rank not
    sending would leave its prompts unfinished), each equal to HF's forward
    pass, and the answer HF's greedy one. One attempt holds only because the
    extractor's session outlasts two ranks starting on two cores
    (``STEADY_SESSION_TIMEOUT_MS``); with 6 s it once expired and every prompt in
    flight was extracted again."""
    topics = fresh_topics(kafka, partitions=1)
    publish(kafka, topics.prompts, as_records(TWO_RANK_PROMPTS))
    status, log = extract(kafka, topics, tmp_path, layout.split("-")[2], "--max-model-len", "512", layout, "2",
                          env=plain_shell_env(kafka.bootstrap))
    assert status == 0, log[-5000:]
    assert f"{BIND_ENV}={rank_binding(os.sched_getaffinity(0), 2)}" in log
    if layout == "--data-parallel-size":
        assert "EngineCore_DP1" in log and "local_rank=0, core ids=[" in log
    records = drain(kafka, topics.blocks, expected=1, timeout=30, settle=3.0)
    sent = Counter((r.key(), h.attempt_id, h.block_index)
                   for r in records for h in [BlockRecordHeaders.from_kafka(r.headers())])
    assert max(sent.values()) == 1, "a record went out twice: a second rank sent it"
    assert len({(key, attempt) for key, attempt, _ in sent}) == len(TWO_RANK_PROMPTS), "one attempt per prompt"
    samples = reassemble(records)
    assert {k: len(v) for k, v in samples.items()} == {str(p["request_id"]): 1 for p in TWO_RANK_PROMPTS}
    reference = HFReference(models.prepare(names=["tiny-llama"])["tiny-llama"])
    layers = default_layer_ids(reference.num_layers)
    for prompt in TWO_RANK_PROMPTS:
        (sample,) = samples[str(prompt["request_id"])]
        m = sample.manifest
        assert m.token_ids[:len(prompt["token_ids"])] == prompt["token_ids"]
        if m.generation is not None:
            answer = m.token_ids[len(prompt["token_ids"]):] + [m.generation.final_token_id]
            assert answer == reference.greedy(prompt["token_ids"], 8)
        assert m.layer_ids == layers
        assert max_relative_error(sample.hidden_states, reference.hidden_states(m.token_ids, layers)) <= 1e-4


def test_more_ranks_than_cores_is_one_line(kafka: KafkaSettings, tmp_path: Path) -> None:
    ranks = len(os.sched_getaffinity(0)) + 1
    status, log = extract(kafka, fresh_topics(kafka, partitions=1), tmp_path, "too-many-ranks",
                          "--tensor-parallel-size", str(ranks), env=plain_shell_env(kafka.bootstrap))
    line = _one_line_usage_error(status, log)
    assert f"--tensor-parallel-size × --data-parallel-size = {ranks} CPU workers need a core each" in line
