"""``hsx extract`` from a plain shell: no ``VLLM_*`` or ``HSX_*`` variables (the
Makefile no longer exports any), so the extractor picks the CPU engine's KV cache
and thread binding itself, keeps what the user set, and says in one line what to
change when memory is too small."""

from __future__ import annotations

import os
from pathlib import Path

import orjson
import pytest
from confluent_kafka import Producer

from hsx import models
from hsx.extractor.cpu_defaults import BIND_ENV, KV_ENV, cpu_list
from hsx.local.commands import extract_command
from hsx.local.spawn import HsxService, cpu_engine_env
from hsx.local.topics import fresh_topics
from tests.drain import drain
from hsx.runtime.settings import KafkaSettings, TopicSettings
from tests.engine_helpers import reassemble

pytestmark = pytest.mark.integration

PROMPTS = [{"request_id": f"plain-{i}", "token_ids": [(i * 31 + k * 17) % 400 + 3 for k in range(n)]}
           for i, n in enumerate([3, 40, 150, 7, 90])]


def plain_shell_env(bootstrap: str, **extra: str) -> dict[str, str]:
    """A user's shell: this environment without any ``VLLM_*`` or ``HSX_*``
    variable but the broker's address."""
    env = {k: v for k, v in cpu_engine_env().items() if not k.startswith(("VLLM_", "HSX_"))}
    return {**env, "HSX_KAFKA_BOOTSTRAP": bootstrap, **extra}


def extract(kafka: KafkaSettings, topics: TopicSettings, log_dir: Path, name: str, *extra: str,
            env: dict[str, str]) -> tuple[int, str]:
    """``hsx extract`` on the tiny model until idle: its exit status and log."""
    tiny = models.prepare(names=["tiny-llama"])["tiny-llama"]
    command = extract_command(kafka.bootstrap, topics, tiny, "--exit-when-idle", "5", *extra,
                              group=f"g-{topics.prompts}")
    with HsxService(name, command, log_dir, env=env) as extractor:
        return extractor.wait(900), extractor.logs()


@pytest.mark.engine
def test_extract_runs_without_any_vllm_variable(kafka: KafkaSettings, tmp_path: Path) -> None:
    topics = fresh_topics(kafka, partitions=1)
    producer = Producer({"bootstrap.servers": kafka.bootstrap})
    for prompt in PROMPTS:
        producer.produce(topics.prompts, key=prompt["request_id"].encode(), value=orjson.dumps(prompt))
    assert producer.flush(30) == 0

    status, log = extract(kafka, topics, tmp_path, "plain", "--max-model-len", "512",
                          env=plain_shell_env(kafka.bootstrap))
    assert status == 0, log[-5000:]
    bind = cpu_list(os.sched_getaffinity(0))
    assert f"CPU engine: {KV_ENV}=1 (GiB) for 128 × 512 tokens, {BIND_ENV}={bind}" in log
    assert "Explicitly set (1.0/" in log  # vLLM's worker used it
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
    status, log = extract(kafka, fresh_topics(kafka, partitions=1), tmp_path, "too-long",
                          "--max-model-len", str(10**9), env=plain_shell_env(kafka.bootstrap))
    line = _one_line_usage_error(status, log)
    assert "--max-model-len 1000000000" in line and KV_ENV in line
