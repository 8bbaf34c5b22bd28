"""Batches from :class:`~hsx.trainer.samples.TrainingSample` lists.

:class:`PackedCollate` is the layout speculators' EAGLE-3 trainer takes (its
``CollateFn``): samples packed one after another into one row of
``total_seq_len`` tokens, the last one cut where the row ends and any further
ones left out, as speculators does::

    hidden_states               [1, N, (L-1)*H]   the aux layers, side by side (cast to ``dtype``)
    verifier_last_hidden_states [1, N, H]         the last slot (cast to ``dtype``)
    input_ids, loss_mask, position_ids            [1, N] int64 (positions restart at 0 per sample)
    document_ids                                  [1, N] int64: the sample of each token, -1 for padding
    lengths                                       [k] int64: tokens of each packed sample
    error_records                                 0 (speculators counts unavailable samples here)

:class:`PaddedCollate` is a plain ``[B, T_max, ...]`` layout for other trainers.
Both add ``request_ids`` and, online, ``positions`` (what ``ReadyStream.commit``
needs). The hidden states are cast while they are copied into the batch: one
copy per sample, none in the dataset.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.utils.data

from hsx.trainer.samples import TrainingSample


def _buffer(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialized buffer; in a DataLoader worker, in shared memory from the
    start (as torch's default collate does), so handing the batch to the trainer
    process costs no second copy."""
    if torch.utils.data.get_worker_info() is None:
        return torch.empty(shape, dtype=dtype)
    typed = torch.empty(0, dtype=dtype)
    storage = typed._typed_storage()._new_shared(math.prod(shape), device="cpu")
    return typed.new(storage).view(shape)


@dataclass
class _Rows:
    """The token-indexed buffers of a batch, ``[rows, ...]`` each."""

    hidden_states: torch.Tensor
    verifier_last_hidden_states: torch.Tensor
    input_ids: torch.Tensor
    loss_mask: torch.Tensor
    position_ids: torch.Tensor

    @classmethod
    def empty(cls, shape: tuple[int, ...], first: TrainingSample, dtype: torch.dtype) -> _Rows:
        """Uninitialized: the caller writes the tokens and zeroes only the padding
        (first-touching a fresh buffer costs as much as the copy into it)."""
        slots, hidden = first.hidden_states.shape[1:]
        if slots < 2:
            raise ValueError(f"sample {first.request_id}: {slots} layer slot(s); EAGLE-3 needs aux layers and the last")
        return cls(_buffer((*shape, (slots - 1) * hidden), dtype), _buffer((*shape, hidden), dtype),
                   *(_buffer(shape, torch.int64) for _ in range(3)))

    def pad(self, at: tuple[int, ...] | tuple[int, slice]) -> None:
        """Zero ``at`` in every buffer (speculators pads with zeros)."""
        for buffer in self.__dict__.values():
            buffer[at] = 0

    def write(self, at: tuple[int, ...] | tuple[int, slice], sample: TrainingSample, rows: int) -> None:
        """Copy the first ``rows`` tokens of ``sample`` to ``at`` (an index of the buffers)."""
        hidden = sample.hidden_states[:rows]
        self.hidden_states[at] = hidden[:, :-1].flatten(1)  # a view: the cast happens in this copy
        self.verifier_last_hidden_states[at] = hidden[:, -1]
        self.input_ids[at] = sample.input_ids[:rows]
        self.loss_mask[at] = sample.loss_mask[:rows]
        self.position_ids[at] = torch.arange(rows)

    def as_dict(self) -> dict[str, torch.Tensor]:
        return dict(self.__dict__)


def _extras(samples: Sequence[TrainingSample]) -> dict[str, Any]:
    extras: dict[str, Any] = {"request_ids": [s.request_id for s in samples]}
    if any(s.position is not None for s in samples):
        extras["positions"] = [s.position for s in samples]
    return extras


def _check(samples: Sequence[TrainingSample]) -> None:
    if not samples:
        raise ValueError("collate: an empty batch")
    shapes = {tuple(s.hidden_states.shape[1:]) for s in samples}
    if len(shapes) > 1:
        raise ValueError(f"collate: samples of different layer slots or widths {sorted(shapes)}")


class PackedCollate:
    """speculators' EAGLE-3 batch: samples packed into ``[1, total_seq_len]``."""

    def __init__(self, total_seq_len: int, dtype: torch.dtype = torch.bfloat16) -> None:
        if total_seq_len < 1:
            raise ValueError(f"total_seq_len {total_seq_len}: must be at least 1")
        self.total_seq_len = total_seq_len
        self.dtype = dtype

    def __call__(self, samples: Sequence[TrainingSample]) -> dict[str, Any]:
        _check(samples)
        n = self.total_seq_len
        rows = _Rows.empty((n,), samples[0], self.dtype)
        document_ids = torch.full((n,), -1, dtype=torch.int64)
        lengths: list[int] = []
        offset = 0
        for document, sample in enumerate(samples):
            if offset == n:
                break
            count = min(sample.num_tokens, n - offset)
            rows.write((slice(offset, offset + count),), sample, count)
            document_ids[offset:offset + count] = document
            lengths.append(count)
            offset += count
        rows.pad((slice(offset, n),))
        batch: dict[str, Any] = {k: v.unsqueeze(0) for k, v in rows.as_dict().items()}
        batch["document_ids"] = document_ids.unsqueeze(0)
        batch["lengths"] = torch.tensor(lengths, dtype=torch.int64)
        batch["error_records"] = 0
        return {**batch, **_extras(samples)}


class PaddedCollate:
    """``[B, T_max, ...]`` with ``attention_mask`` and ``lengths [B]``; ``max_len``
    cuts longer samples; ``input_ids`` are padded with ``pad_token_id``."""

    def __init__(self, dtype: torch.dtype = torch.bfloat16, max_len: int | None = None, pad_token_id: int = 0) -> None:
        if max_len is not None and max_len < 1:
            raise ValueError(f"max_len {max_len}: must be at least 1")
        self.dtype = dtype
        self.max_len = max_len
        self.pad_token_id = pad_token_id

    def __call__(self, samples: Sequence[TrainingSample]) -> dict[str, Any]:
        _check(samples)
        counts = [min(s.num_tokens, self.max_len or s.num_tokens) for s in samples]
        rows = _Rows.empty((len(samples), max(counts)), samples[0], self.dtype)
        attention = torch.zeros((len(samples), max(counts)), dtype=torch.bool)
        for i, (sample, count) in enumerate(zip(samples, counts, strict=True)):
            rows.write((i, slice(0, count)), sample, count)
            rows.pad((i, slice(count, None)))
            attention[i, :count] = True
        rows.input_ids[~attention] = self.pad_token_id
        return {**rows.as_dict(), "attention_mask": attention, "lengths": torch.tensor(counts, dtype=torch.int64),
                **_extras(samples)}
