"""Gathering one request's hidden states out of the dummy draft model's paged cache.

The cache is ``[num_blocks, num_layers, block_size, hidden]``; token ``t`` of a
request lives in block ``block_ids[t // block_size]`` at slot ``t % block_size``.
One advanced-indexing op gathers ``[num_tokens, num_layers, hidden]`` (the two
indices are separated by a slice, so the indexed dimension comes first).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch


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
    """``[num_tokens, num_layers, hidden]``, contiguous, in host memory."""
    event: torch.cuda.Event | None = None
    release: Callable[[], None] | None = None
    """Pinned buffer to give back to its pool once the bytes are encoded."""

    def wait(self) -> torch.Tensor:
        """Block until the device-to-host copy finished; returns the tensor."""
        if self.event is not None:
            self.event.synchronize()
        return self.tensor


def gather_cpu(cache: torch.Tensor, block_ids: list[int], num_tokens: int, block_size: int,
               first: int = 0) -> Gathered:
    """CPU backend: the gather is itself the one copy into a fresh tensor."""
    blocks, slots = gather_index(block_ids, num_tokens, block_size, first)
    return Gathered(cache[blocks, :, slots])


class PinnedPool:
    """Reusable pinned host buffers: allocating pinned memory per request is slow
    (it maps pages with the driver), so buffers are kept and reused."""

    def __init__(self, dtype: torch.dtype) -> None:
        self._dtype = dtype
        self._free: list[torch.Tensor] = []
        self._lock = threading.Lock()

    def take(self, numel: int) -> torch.Tensor:
        with self._lock:
            fitting = [b for b in self._free if b.numel() >= numel]
            if fitting:
                buffer = min(fitting, key=torch.Tensor.numel)
                self._free.remove(buffer)
                return buffer
        # Round up so that slightly longer requests reuse the buffer later.
        return torch.empty(1 << max(numel - 1, 1).bit_length(), dtype=self._dtype, pin_memory=True)

    def give_back(self, buffer: torch.Tensor) -> None:
        with self._lock:
            self._free.append(buffer)


class CudaGatherer:
    """CUDA backend: gather on a side stream (ordered after the forward pass that
    wrote the cache), copy into a pinned host buffer, and record an event the
    sender thread waits on; the engine's own stream never waits for us."""

    def __init__(self, cache: torch.Tensor) -> None:
        self._stream = torch.cuda.Stream(device=cache.device)
        self._pool = PinnedPool(cache.dtype)

    def gather(self, cache: torch.Tensor, block_ids: list[int], num_tokens: int, block_size: int,
               first: int = 0) -> Gathered:
        blocks, slots = gather_index(block_ids, num_tokens, block_size, first)
        _, layers, _, hidden = cache.shape
        rows = num_tokens - first
        numel = rows * layers * hidden
        buffer = self._pool.take(numel)
        host = buffer[:numel].view(rows, layers, hidden)
        self._stream.wait_stream(torch.cuda.current_stream(cache.device))
        with torch.cuda.stream(self._stream):
            device_rows = cache[blocks.to(cache.device, non_blocking=True), :, slots.to(cache.device, non_blocking=True)]
            host.copy_(device_rows, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self._stream)
        return Gathered(host, event, release=lambda: self._pool.give_back(buffer))
