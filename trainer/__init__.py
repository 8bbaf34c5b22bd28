"""Training on hsx data: PyTorch loaders and batches for speculators' EAGLE-3
trainer. Built on ``sink.reader``; imports only ``sink``, ``runtime`` and ``schemas``.

- :class:`~trainer.dataset.HsxDataset`: map-style, random access by row or request id.
- :class:`~trainer.online.ReadyStream`: iterable over ``hidden_states.ready``, for
  online training, with commits after the trainer's step and a resumable state.
- :class:`~trainer.collate.PackedCollate` (speculators' layout) and
  :class:`~trainer.collate.PaddedCollate`.
- ``trainer.export``: ``hsx export --format speculators``.
"""

from trainer.collate import PackedCollate, PaddedCollate
from trainer.dataset import HsxDataset
from trainer.online import ReadyStream
from trainer.samples import LayerLayout, TrainingSample, choose_layers

__all__ = ["HsxDataset", "LayerLayout", "PackedCollate", "PaddedCollate", "ReadyStream", "TrainingSample",
           "choose_layers"]
