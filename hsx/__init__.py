"""hsx: streaming hidden-state extraction with vLLM and Kafka.

Every module lives under this one namespace: the ``hsx`` command and the demo
(:mod:`hsx.cli`, :mod:`hsx.demo`), the three services (:mod:`hsx.producer`,
:mod:`hsx.extractor`, :mod:`hsx.sink`), what trainers import (:mod:`hsx.trainer`),
the wire contracts (:mod:`hsx.schemas`) and shared helpers (:mod:`hsx.runtime`).

The public API, importable from ``hsx`` itself:

- :func:`open_dataset` and :func:`follow` (:mod:`hsx.dataset.reader`): read a dataset
  the sink wrote, or follow it as ``hidden_states.ready`` events arrive.
- :class:`HsxDataset`, :class:`ReadyStream` and :class:`PackedCollate`
  (:mod:`hsx.trainer`): PyTorch loaders and speculators' EAGLE-3 batches (need torch).
- :class:`PromptEvent` (:mod:`hsx.schemas`): one prompt as ``hsx produce`` publishes it.

Each name is imported on first access (PEP 562), so ``import hsx`` loads neither
torch nor vLLM, and ``hsx.open_dataset`` works where torch is not installed.
Everything else is internal: import it from its module at your own risk.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hsx.dataset.reader import follow, open_dataset
    from hsx.schemas import PromptEvent
    from hsx.trainer.collate import PackedCollate
    from hsx.trainer.dataset import HsxDataset
    from hsx.trainer.online import ReadyStream

__all__ = ["HsxDataset", "PackedCollate", "PromptEvent", "ReadyStream", "follow", "open_dataset"]

# Public name -> the module that defines it; keep in step with the TYPE_CHECKING block.
_LAZY = {
    "open_dataset": "hsx.dataset.reader",
    "follow": "hsx.dataset.reader",
    "HsxDataset": "hsx.trainer.dataset",
    "ReadyStream": "hsx.trainer.online",
    "PackedCollate": "hsx.trainer.collate",
    "PromptEvent": "hsx.schemas",
}


def __getattr__(name: str) -> Any:
    """Import a public name's module on first access and cache the name here."""
    module = _LAZY.get(name)
    if module is None:
        # An AttributeError (not ImportError) lets ``from hsx import models`` fall
        # back to importing the submodule.
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later accesses skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
