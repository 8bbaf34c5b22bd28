"""A map-style ``torch.utils.data.Dataset`` over a dataset written by ``hsx sink``.

    ds = HsxDataset("out/", layers=[2, 15, 27])
    loader = DataLoader(ds, batch_sampler=..., num_workers=4, collate_fn=PackedCollate(8192, torch.bfloat16))

Row ``i`` is the i-th trainable sample in index order, the same row ``i`` as in
``hsx export --format speculators`` of the same dataset with the same options.
Shards are opened lazily, in the process that reads them: a DataLoader worker
gets a copy without open handles and maps the files itself, so the dataset is
safe with ``num_workers > 0`` and with ``DistributedSampler``. An ``s3://``
dataset is read with ranged GETs; its workers need
``multiprocessing_context="forkserver"`` (or ``"spawn"``): the object-store
client does not survive ``fork()``, and a forked worker says so at once.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch
import torch.utils.data

from hsx.dataset.encoding import read_token_ids
from hsx.dataset.reader import open_dataset
from hsx.schemas import HiddenStatesReady
from hsx.schemas.training import LossMaskPolicy
from hsx.trainer.samples import LayerLayout, TrainingSample, check_trainable, choose_layers, loss_mask, read_sample


class HsxDataset(torch.utils.data.Dataset[TrainingSample]):
    """Random access by row (``ds[3]``) or by request id (``ds["chat-42"]``).

    ``layers``: the aux layers, picked and ordered (default: all stored but the
    last). ``loss_mask``: the mask of samples stored without one (plain text).
    ``drop_unsupervised``: leave out rows without a supervised token, as
    speculators' data preparation does (``dropped`` counts them).
    """

    def __init__(self, path: str | Path, layers: Sequence[int] | None = None, loss_mask: LossMaskPolicy = "all",
                 drop_unsupervised: bool = True, max_open_shards: int = 16) -> None:
        source = open_dataset(path)
        events = [source.event(r) for r in source.request_ids()]
        if not events:
            raise ValueError(f"dataset {path}: holds no samples yet")
        for event in events:
            check_trainable(event)
        self.layout: LayerLayout = choose_layers(events[0].layer_ids, layers)
        shapes = {(tuple(e.layer_ids), e.hidden_size, e.dtype) for e in events}
        if len(shapes) > 1:
            raise ValueError(f"dataset {path}: samples of {len(shapes)} layer sets, widths or dtypes; "
                             "a loader reads one (export or open them apart)")
        self.hidden_size = events[0].hidden_size
        self.policy: LossMaskPolicy = loss_mask
        self._shards = source.shards
        self._events: list[HiddenStatesReady] = []
        self.dropped = 0
        for event in events:
            if drop_unsupervised and not self._supervised(event):
                self.dropped += 1
                continue
            self._events.append(event)
        self._rows = {e.request_id: i for i, e in enumerate(self._events)}

    def _supervised(self, event: HiddenStatesReady) -> bool:
        if event.tensors.loss_mask is None:
            return self.policy == "all"
        return bool(loss_mask(self._shards.get(event.shard), event, self.policy).any())

    def __len__(self) -> int:
        return len(self._events)

    def __getitem__(self, key: int | str) -> TrainingSample:
        event = self._events[self.row(key) if isinstance(key, str) else key]
        return read_sample(self._shards.get(event.shard), event, self.layout, self.policy)

    def tokens(self, row: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(input_ids, loss_mask)`` of a row, without its hidden states."""
        event = self._events[row]
        shard = self._shards.get(event.shard)
        return read_token_ids(shard, event), loss_mask(shard, event, self.policy)

    def row(self, request_id: str) -> int:
        """The row of a request id; ``KeyError`` naming it when absent (or dropped)."""
        try:
            return self._rows[request_id]
        except KeyError:
            raise KeyError(f"no trainable sample {request_id!r} in this dataset") from None

    def event(self, row: int) -> HiddenStatesReady:
        """The ready event behind a row (shard, model, layer ids, metadata)."""
        return self._events[row]

    @property
    def lengths(self) -> list[int]:
        """Tokens per row, without reading a shard: what a packing batch sampler
        (speculators' ``MultipackDistributedBatchSamplerV2``) needs."""
        return [e.num_tokens for e in self._events]
