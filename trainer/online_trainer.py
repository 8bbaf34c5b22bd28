"""``hsx train-draft``'s adaptations of speculators' trainer: its epoch loop over
a stream that has no end, each epoch ending in a checkpoint and then a commit,
and its per-step metrics as hsx log lines."""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hsx.trainer.draft_checks import STREAM_STATE
from hsx.trainer.online import ReadyStream
from hsx.trainer.stream_batches import StreamEpochs

log = logging.getLogger("hsx.trainer.draft")  # the command's logger: one name in the command's log lines


def online_trainer_class() -> type:
    """speculators' ``Trainer`` subclassed for a stream (imported late: hsx's vLLM environment lacks
    speculators)."""
    from speculators.train.trainer import Trainer

    class OnlineTrainer(Trainer):  # type: ignore[misc,valid-type]
        """speculators' Trainer over :class:`StreamEpochs`: every epoch ends in a
        checkpoint and a commit of the samples it holds."""

        def __init__(self, model: Any, config: Any, epochs: StreamEpochs, stream: ReadyStream,
                     on_checkpoint: Callable[[Path], object] | None = None) -> None:
            self.epochs = epochs
            self.stream = stream
            self.on_checkpoint = on_checkpoint
            """Called with each checkpoint once committed (the gate: :mod:`hsx.trainer.gate`)."""
            self.saved: Path | None = None
            """The last checkpoint this run wrote."""
            super().__init__(model, config, epochs, None)

        def run_training(self) -> None:
            """speculators' epoch loop without validation (a stream holds none
            back), ending early when the stream does."""
            for epoch in range(self.current_epoch, self.config.num_epochs):
                steps_before = self.global_step
                self.train_epoch(epoch, step_callback=self.epochs.trained)
                if self.global_step > steps_before:
                    self.maybe_save_checkpoint(epoch)
                    self.saved = self.checkpointer.path / str(epoch)
                    self._commit(self.saved)
                    if self.on_checkpoint is not None:
                        self.on_checkpoint(self.saved)
                max_steps = self.config.max_steps  # None: until stopped
                if self.epochs.ended or (max_steps is not None and self.global_step >= max_steps):
                    break

        def _commit(self, checkpoint: Path) -> None:
            """The stream's position goes into the checkpoint, then to Kafka:
            a restart finds it in either, never a commit ahead of the weights."""
            self.stream.mark({"positions": self.epochs.take_consumed()})
            state = checkpoint / STREAM_STATE
            tmp = state.with_suffix(".tmp")
            tmp.write_text(json.dumps(self.stream.state_dict()))
            tmp.replace(state)
            self.stream.commit()

    return OnlineTrainer


class StepLog(logging.Handler):
    """speculators' per-step metrics (the ``speculators.metrics`` logger) as one
    hsx log line per step, with ``step``, ``loss`` and ``samples`` fields in JSON
    logs; keeps the losses for the summary."""

    def __init__(self, epochs: StreamEpochs) -> None:
        super().__init__()
        self.epochs = epochs
        self.losses: list[float] = []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.msg
        if not isinstance(message, dict) or "train" not in message:
            return  # speculators' run config and validation metrics
        metrics = message["train"]
        loss = float(metrics["loss"])
        self.losses.append(loss)
        step = int(message["global_step"]) + 1
        accuracy = {k: round(float(v), 4) for k, v in metrics.items() if k.startswith("full_acc")}
        log.info("step %d: loss %.4f, first-token accuracy %.3f, %d samples so far", step, loss,
                 accuracy.get("full_acc_0", math.nan), self.epochs.handed_out,
                 extra={"step": step, "loss": loss, "samples": self.epochs.handed_out, "lr": message.get("lr"),
                        **accuracy})
