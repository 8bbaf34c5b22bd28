"""``hsx train-draft``'s batches: the ready stream's samples packed in
speculators' layout (its ``CollateFn``, with EAGLE-3's ``shift_batch`` for the
types trained shifted), handed to speculators' Trainer as epochs of a stream
that has no end."""

from __future__ import annotations

import signal
import time
from collections.abc import Iterable, Iterator
from types import FrameType
from typing import Any

import torch
import torch.utils.data

from hsx.trainer.online import ReadyStream
from hsx.trainer.samples import TrainingSample


class PackedSamples(torch.utils.data.IterableDataset[list[TrainingSample]]):
    """The stream's samples in groups that fill at most ``total_seq_len`` tokens
    as collated (``shifted``: EAGLE-3 trains on ``T - 1`` positions of a
    ``T``-token sample, DFlash on ``T``). A sample that does not fit starts the
    next group, so none is cut, unless it alone is longer than
    ``total_seq_len`` (speculators' collate cuts it)."""

    def __init__(self, stream: ReadyStream, total_seq_len: int, shifted: bool = True) -> None:
        self.stream = stream
        self.total_seq_len = total_seq_len
        self.shifted = shifted

    def __iter__(self) -> Iterator[list[TrainingSample]]:
        return packed(self.stream, self.total_seq_len, self.shifted)


def packed(samples: Iterable[TrainingSample], total_seq_len: int, shifted: bool = True
           ) -> Iterator[list[TrainingSample]]:
    """``samples`` in order, in groups that fill at most ``total_seq_len`` tokens
    as collated (one fewer a sample when ``shifted``); one longer than that
    alone in its group."""
    group: list[TrainingSample] = []
    tokens = 0
    for sample in samples:
        collated = max(sample.num_tokens - int(shifted), 0)
        if group and tokens + collated > total_seq_len:
            yield group
            group, tokens = [], 0
        group.append(sample)
        tokens += collated
    if group:
        yield group


class SpeculatorsBatch:
    """speculators' ``CollateFn`` (with ``shift_batch`` when ``shifted``, as its
    train does for EAGLE-3 and P-EAGLE), over samples given as its
    ``ArrowDataset`` gives them (aux layers side by side, the last slot as the
    verifier's last hidden state, ``lengths`` and ``position_ids`` as its
    ``BaseDataset`` adds them). Adds ``positions`` for the commit. Picklable, for
    DataLoader workers."""

    def __init__(self, total_seq_len: int, hidden_size: int, num_aux: int, dtype: torch.dtype,
                 shifted: bool = True) -> None:
        from speculators.models.eagle3.data import shift_batch
        from speculators.train.data import CollateFn

        self.collate = CollateFn(total_seq_len, hidden_size, num_target_layers=num_aux, dtype=dtype,
                                 preprocess=shift_batch if shifted else None)

    def __call__(self, samples: list[TrainingSample]) -> dict[str, Any]:
        rows = [{"hidden_states": s.hidden_states[:, :-1].flatten(1), "input_ids": s.input_ids,
                 "verifier_last_hidden_states": s.hidden_states[:, -1], "loss_mask": s.loss_mask,
                 "lengths": torch.tensor([s.num_tokens], dtype=torch.long),
                 "position_ids": torch.arange(s.num_tokens, dtype=torch.long)} for s in samples]
        return {**self.collate(rows), "positions": [s.position for s in samples]}


class _Stop(Exception):
    """A drain signal arrived while the trainer waited for a batch."""


class StreamEpochs:
    """The stream as speculators' Trainer takes a ``train_loader``: each
    ``iter()`` is one epoch of at most ``len()`` batches, all drawn from one
    DataLoader iterator, so the stream goes on across epochs. Takes each batch's
    ``positions`` out (the model is called with the batch's keys) and keeps
    them until :meth:`trained` says the step is done."""

    batch_sampler = None  # the Trainer looks for epoch and resume hooks on it; a stream has neither

    def __init__(self, loader: torch.utils.data.DataLoader[Any], steps_per_epoch: int,
                 max_samples: int | None) -> None:
        self.loader = loader
        self.steps_per_epoch = steps_per_epoch
        self.max_samples = max_samples
        self.handed_out = 0
        """Samples in the batches handed to the trainer (the one in its step included)."""
        self.ended: str | None = None
        """Why no batch comes any more: the stream went idle, ``max_samples`` were
        trained on, or a drain was asked for."""
        self.training_seconds = 0.0
        """From handing out the first batch to the end of the last step: the steps
        and the waits for batches between them, not the start or an idle end."""
        self._stop_asked = False
        self._batches: Iterator[dict[str, Any]] | None = None
        self._first_batch_at: float | None = None
        self._in_step: list[Any] = []
        self._consumed: list[Any] = []
        self._fetching = False

    def __len__(self) -> int:
        return self.steps_per_epoch

    def __iter__(self) -> Iterator[dict[str, Any]]:
        for _ in range(self.steps_per_epoch):
            if self._stop_asked:
                self.ended = "stopped on request"
            elif self.max_samples is not None and self.handed_out >= self.max_samples:
                self.ended = "--max-samples reached"
            if self.ended:
                return
            try:
                self._fetching = True
                if self._batches is None:
                    self._batches = iter(self.loader)
                batch = next(self._batches)
            except StopIteration:
                self.ended = "the stream went idle (--exit-when-idle)"
                return
            except _Stop:
                self.ended = "stopped on request"
                return
            finally:
                self._fetching = False
            self._in_step = batch.pop("positions")
            self.handed_out += len(self._in_step)
            if self._first_batch_at is None:
                self._first_batch_at = time.monotonic()
            yield batch

    def trained(self) -> None:
        """The step on the last batch handed out is done (speculators' step callback)."""
        self._consumed += self._in_step
        self._in_step = []
        assert self._first_batch_at is not None  # a step had a batch
        self.training_seconds = time.monotonic() - self._first_batch_at

    def take_consumed(self) -> list[Any]:
        """The positions of every sample trained on since the last call."""
        consumed, self._consumed = self._consumed, []
        return consumed

    def ask_stop(self, _signum: int, _frame: FrameType | None) -> None:
        """Signal handler: finish the step in progress, then end; a wait for the
        next batch is cut short. A second signal acts as if hsx had none."""
        self._stop_asked = True
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        if self._fetching:
            raise _Stop
