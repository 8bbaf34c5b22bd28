"""The trainer side: read a dataset written by ``hsx sink``.

    from sink.reader import open_dataset
    ds = open_dataset("out/")
    sample = ds["chat-42"]          # dict: request_id, token_ids, hidden_states [T, L, H], loss_mask, metadata
    for sample in ds: ...            # in index order

Shards are memory-mapped (safetensors ``safe_open``); a sample costs only the
pages it touches.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from safetensors import safe_open

from schemas import HiddenStatesReady
from sink.shards import read_indexes
from sink.storage import LocalStorage


class Dataset:
    """A read-only view of a dataset directory, as of when it was opened."""

    def __init__(self, root: Path, max_open_shards: int = 16) -> None:
        self._storage = LocalStorage(root)
        self._events: dict[str, HiddenStatesReady] = {}
        for index in read_indexes(self._storage):
            for event in index.events:
                # The sink writes each request id once; keep the first if a
                # hand-made directory ever disagrees.
                self._events.setdefault(event.request_id, event)
        self._open: OrderedDict[str, Any] = OrderedDict()
        self._max_open = max_open_shards

    def __len__(self) -> int:
        return len(self._events)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._events

    def __iter__(self) -> Iterator[dict[str, Any]]:
        for request_id in self._events:
            yield self[request_id]

    def request_ids(self) -> list[str]:
        return list(self._events)

    def event(self, request_id: str) -> HiddenStatesReady:
        """The ready event (shard, tensor names, shapes, model) of one sample."""
        return self._events[request_id]

    def __getitem__(self, request_id: str) -> dict[str, Any]:
        event = self._events[request_id]
        shard = self._shard(event.shard)
        names = event.tensors
        return {
            "request_id": request_id,
            "token_ids": shard.get_tensor(names.token_ids),
            "hidden_states": shard.get_tensor(names.hidden_states),
            "loss_mask": shard.get_tensor(names.loss_mask) if names.loss_mask else None,
            "metadata": event.metadata or {},
        }

    def _shard(self, relative: str) -> Any:
        if relative in self._open:
            self._open.move_to_end(relative)
            return self._open[relative]
        handle = safe_open(str(self._storage.local_path(relative)), framework="pt")
        self._open[relative] = handle
        if len(self._open) > self._max_open:
            self._open.popitem(last=False)
        return handle


def open_dataset(path: str | Path) -> Dataset:
    """Open the dataset at ``path`` (the sink's ``--output`` directory)."""
    root = Path(path)
    if not root.is_dir():
        raise FileNotFoundError(f"no dataset at {root}")
    return Dataset(root)
