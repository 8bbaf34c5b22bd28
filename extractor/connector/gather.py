"""Gathering one request's hidden states out of the dummy draft model's paged cache.

The cache is ``[num_blocks, num_layers, block_size, hidden]``; token ``t`` of a
request lives in block ``block_ids[t // block_size]`` at slot ``t % block_size``.
One advanced-indexing op gathers ``[num_tokens, num_layers, hidden]`` (the two
indices are separated by a slice, so the indexed dimension comes first).

Only torch is imported (and :mod:`hsx.extractor.connector.fp8`), so this module runs
where vLLM is absent: ``bench/gpu_check.py`` checks it on a bare GPU host.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch

from hsx.extractor.connector.fp8 import quantize


def gather_index(block_ids: list[int], num_tokens: int, block_size: int,
                 first: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """The (block, slot) of each token position in ``[first, num_tokens)``."""
    positions = torch.arange(first, num_tokens)
    blocks = torch.as_tensor(block_ids, dtype=torch.long)[positions // block_size]
    return blocks, positions % block_size


@dataclass
class Gathered:
    """Hidden states on the host, possibly still being copied (CUDA)."""

    tensor: torch.Tensor
    """``[num_tokens, num_layers, hidden]``, contiguous, in host memory: the cache's
    dtype, or uint8 E4M3FN codes when gathered as fp8."""
    event: torch.cuda.Event | None = None
    release: Callable[[], None] | None = None
    """Pinned buffer to give back to its pool once the bytes are encoded."""
    scales: torch.Tensor | None = None
    """fp8 only: the ``[num_tokens, num_layers]`` float32 scales (``hsx.codecs.fp8``)."""
    dtype: torch.dtype | None = None
    """The cache's dtype, which fp8 codes dequantize to; ``tensor.dtype`` when unset."""

    @property
    def source_dtype(self) -> torch.dtype:
        """The element type the hidden states had in the cache (the model's)."""
        return self.dtype or self.tensor.dtype

    def wait(self) -> torch.Tensor:
        """Block until the device-to-host copy finished; returns the tensor."""
        if self.event is not None:
            self.event.synchronize()
        return self.tensor


def gather_rows(cache: torch.Tensor, block_ids: list[int], num_tokens: int, block_size: int,
                first: int = 0) -> torch.Tensor:
    """The rows ``[first, num_tokens)`` as one new tensor on the cache's device."""
    blocks, slots = gather_index(block_ids, num_tokens, block_size, first)
    if cache.device.type != "cpu":
        blocks, slots = blocks.to(cache.device, non_blocking=True), slots.to(cache.device, non_blocking=True)
    return cache[blocks, :, slots]


def gather_cpu(cache: torch.Tensor, block_ids: list[int], num_tokens: int, block_size: int,
               first: int = 0, *, fp8: bool = False) -> Gathered:
    """CPU backend: the gather is itself the one copy into a fresh tensor; with
    ``fp8`` it is quantized as the CUDA backend does, the same codes and scales."""
    rows = gather_rows(cache, block_ids, num_tokens, block_size, first)
    if not fp8:
        return Gathered(rows)
    codes, scales = quantize(rows)
    return Gathered(codes, scales=scales, dtype=rows.dtype)


class PinnedPool:
    """Reusable pinned host buffers: allocating pinned memory per request is slow
    (it maps pages with the driver), so buffers are kept and reused."""

    def __init__(self, dtype: torch.dtype) -> None:
        self._dtype = dtype
        self._free: list[torch.Tensor] = []
        self._lock = threading.Lock()

    def take(self, numel: int) -> torch.Tensor:
        with self._lock:
            # By index: list.remove would compare tensors with ==, element by element.
            fitting = [i for i, b in enumerate(self._free) if b.numel() >= numel]
            if fitting:
                return self._free.pop(min(fitting, key=lambda i: self._free[i].numel()))
        # Round up so that slightly longer requests reuse the buffer later.
        return torch.empty(1 << max(numel - 1, 1).bit_length(), dtype=self._dtype, pin_memory=True)

    def give_back(self, buffer: torch.Tensor) -> None:
        with self._lock:
            self._free.append(buffer)


class CudaGatherer:
    """CUDA backend: gather on a side stream (ordered after the forward pass that
    wrote the cache), copy into a pinned host buffer, and record an event the
    sender thread waits on; the engine's own stream never waits for us.

    With ``fp8=True`` the rows are quantized on the device before the copy
    (:func:`hsx.extractor.connector.fp8.quantize`), which halves the bytes over PCIe
    for bf16 caches; the codes and scales land in pinned buffers of their own."""

    def __init__(self, cache: torch.Tensor) -> None:
        self._stream = torch.cuda.Stream(device=cache.device)
        self._pools = {dtype: PinnedPool(dtype) for dtype in (cache.dtype, torch.uint8, torch.float32)}

    def gather(self, cache: torch.Tensor, block_ids: list[int], num_tokens: int, block_size: int,
               first: int = 0, *, fp8: bool = False) -> Gathered:
        self._stream.wait_stream(torch.cuda.current_stream(cache.device))
        with torch.cuda.stream(self._stream):
            device_rows = gather_rows(cache, block_ids, num_tokens, block_size, first)
            parts = quantize(device_rows) if fp8 else (device_rows,)
            taken = []  # (pool, buffer) per part, handed back together by release()
            for part in parts:
                pool = self._pools[part.dtype]
                buffer = pool.take(part.numel())
                taken.append((pool, buffer))
                buffer[: part.numel()].view(part.shape).copy_(part, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self._stream)
        hosts = [buffer[: part.numel()].view(part.shape) for (_, buffer), part in zip(taken, parts)]

        def release() -> None:
            for pool, buffer in taken:
                pool.give_back(buffer)

        return Gathered(hosts[0], event, release=release, scales=hosts[1] if fp8 else None, dtype=cache.dtype)
