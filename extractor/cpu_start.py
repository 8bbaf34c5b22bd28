"""Starting vLLM's CPU engine with :mod:`hsx.extractor.cpu_defaults`' choices:
:func:`worker_in_engine_core` runs the worker inside the EngineCore process;
:func:`start_failure_reason` turns a start that failed for lack of memory into
one line (:func:`explain_start_failure` for an engine's options)."""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from hsx.extractor.cpu_defaults import (ENGINE_OVERHEAD, GiB, KV_ENV, CpuDefaults, available_memory, engine_setting,
                                        gib_text)
from hsx.extractor.model_config import dtype_bytes, text_config, weight_bytes


@contextmanager
def worker_in_engine_core(defaults: CpuDefaults | None, args: Any) -> Iterator[None]:
    """Around the start of the engine of ``args`` (``AsyncEngineArgs``): where
    ``defaults`` has a ``worker_env``, take vLLM's single-process executor and set
    that environment for the EngineCore process the start spawns.

    The executor is passed as its class: vLLM's CPU platform replaces the name
    ``"uni"`` with its multiprocessing executor, whose Worker process re-imports
    torch and vLLM (measured on 2 cores, SmolLM2-135M eager: a start of 26 s takes
    15 s without it, same tokens). ``os.environ`` is restored afterwards: the
    process running hsx keeps its own threads."""
    if defaults is None or not defaults.worker_env:
        yield
        return
    from vllm.v1.executor.uniproc_executor import UniProcExecutor

    args.distributed_executor_backend = UniProcExecutor
    saved = {name: os.environ.get(name) for name in defaults.worker_env}
    os.environ.update(defaults.worker_env)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def start_failure_reason(message: str, environ: Mapping[str, str], available_bytes: int,
                         weights: int) -> str | None:
    """One line for a vLLM engine start that failed for lack of memory, or ``None``.

    The worker's ``ValueError`` stays in its own process (the caller sees "Engine core
    initialization failed"), so besides its text this checks the numbers again: a
    cache that no longer fits beside the weights and vLLM's processes."""
    kv = environ.get(KV_ENV, "")
    said_memory = "memory" in message.lower()
    if kv.isdigit():
        short = int(kv) * GiB + weights + ENGINE_OVERHEAD > available_bytes
        if said_memory or short:
            return (f"vLLM's CPU engine did not start: {KV_ENV}={kv} GiB of KV cache does not fit beside the "
                    f"weights and vLLM's processes in the {gib_text(available_bytes)} of memory available; "
                    f"lower {KV_ENV}, --max-model-len or --max-num-seqs, or free memory")
    elif said_memory:  # the user sized memory through --engine-arg
        return (f"vLLM's CPU engine did not start for lack of memory ({gib_text(available_bytes)} available): set "
                f"{KV_ENV} (GiB of KV cache) or lower --engine-arg gpu_memory_utilization")
    return None


def explain_start_failure(options: Any, exc: BaseException) -> str | None:
    """:func:`start_failure_reason` for a failed start of ``options``' engine."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return None
    weights = weight_bytes(text_config(options.model), dtype_bytes(engine_setting(options, "dtype")))
    return start_failure_reason(str(exc), os.environ, available_memory(), weights)
