"""Training on hsx data: PyTorch loaders and batches for speculators' EAGLE-3
trainer. Built on ``hsx.dataset.reader``; imports only ``hsx.sink``, ``hsx.runtime`` and ``hsx.schemas``.

- :class:`~hsx.trainer.dataset.HsxDataset`: map-style, random access by row or request id.
- :class:`~hsx.trainer.online.ReadyStream`: iterable over ``hidden_states.ready``, for
  online training, with commits after the trainer's step and a resumable state.
- :class:`~hsx.trainer.collate.PackedCollate` (speculators' layout) and
  :class:`~hsx.trainer.collate.PaddedCollate`.
- ``hsx.trainer.export``: ``hsx export --format speculators``.
"""

from hsx.trainer.collate import PackedCollate, PaddedCollate
from hsx.trainer.dataset import HsxDataset
from hsx.trainer.online import ReadyStream
from hsx.trainer.samples import LayerLayout, TrainingSample, choose_layers

__all__ = ["HsxDataset", "LayerLayout", "PackedCollate", "PaddedCollate", "ReadyStream", "TrainingSample",
           "choose_layers"]
