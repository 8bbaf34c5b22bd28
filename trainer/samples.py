"""One training sample read from a shard, the layer slots it is given in, and the
loss mask of samples stored without one. Shared by the export, the map-style
dataset and the online loader, so that all three hand a trainer the same rows."""

from __future__ import annotations

import argparse
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from hsx.dataset.encoding import check_raw, read_hidden_states, read_loss_mask, read_token_ids
from hsx.dataset.shard_reader import prefetch
from hsx.schemas import HiddenStatesReady
from hsx.schemas.dataset_codec import DatasetCodec
from hsx.schemas.training import SERVED_AUX_LAYERS, LossMaskPolicy

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LayerLayout:
    """Which stored layers a trainer gets, in which slots: the aux layers in the
    order a draft config lists them (its ``target_layer_ids``), then the
    verifier's last layer, the highest stored id (hsx's ``num_hidden_layers``:
    the last layer's output before the final norm)."""

    stored: tuple[int, ...]
    aux: tuple[int, ...]

    @property
    def verifier(self) -> int:
        return self.stored[-1]

    @property
    def slots(self) -> tuple[int, ...]:
        """The layer id of each slot of ``TrainingSample.hidden_states``."""
        return (*self.aux, self.verifier)

    @property
    def indices(self) -> list[int]:
        """Where each slot's layer lies among the stored ones."""
        return [self.stored.index(layer) for layer in self.slots]


def choose_layers(stored: Sequence[int], aux: Sequence[int] | None = None) -> LayerLayout:
    """The layout for samples that store ``stored`` (sorted, as the sink stores
    them); ``aux`` picks and orders the aux layers (default: every stored layer
    but the last, ascending). Raises ``ValueError`` in one line."""
    ordered = tuple(sorted(stored))
    if len(ordered) < 2:
        raise ValueError(f"layers {list(stored)}: EAGLE-3 needs at least one aux layer besides the last")
    picked = ordered[:-1] if aux is None else tuple(aux)
    if not picked:
        raise ValueError("--layers: give at least one aux layer")
    if len(set(picked)) != len(picked):
        raise ValueError(f"--layers {','.join(map(str, picked))}: a layer is listed twice")
    missing = [layer for layer in picked if layer not in ordered]
    if missing:
        raise ValueError(f"--layers {','.join(map(str, picked))}: layer {missing[0]} is not stored "
                         f"(the dataset holds {','.join(map(str, ordered))})")
    if ordered[-1] in picked:
        raise ValueError(f"--layers {','.join(map(str, picked))}: {ordered[-1]} is the verifier's last layer, "
                         "always the last slot; list only aux layers")
    if list(picked) != sorted(picked):
        log.warning("--layers %s: not ascending; vLLM hands an EAGLE-3 draft its aux hidden states in layer order, "
                    "so a draft trained in this order would see them in another when served",
                    ",".join(map(str, picked)))
    if len(picked) != SERVED_AUX_LAYERS:
        log.warning("--layers %s: %d aux layers; vLLM loads a speculators EAGLE-3 draft with %d only (it sizes the "
                    "draft's input for %d unless its model config says otherwise)", ",".join(map(str, picked)),
                    len(picked), SERVED_AUX_LAYERS, SERVED_AUX_LAYERS)
    return LayerLayout(stored=ordered, aux=picked)


def layer_list(text: str) -> list[int]:
    """argparse ``type=`` for ``--layers 2,15,27``."""
    try:
        layers = [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: comma-separated layer ids, e.g. 2,15,27") from None
    if any(layer < 0 for layer in layers):
        raise argparse.ArgumentTypeError(f"{text!r}: layer ids are non-negative")
    return layers


@dataclass
class TrainingSample:
    """A sample as a trainer takes it. ``hidden_states`` is ``[T, slots, H]`` in the
    stored dtype (collate casts), its last slot the verifier's last layer."""

    request_id: str
    input_ids: torch.Tensor
    """``[T]`` int64."""
    hidden_states: torch.Tensor
    loss_mask: torch.Tensor
    """``[T]`` int64 (what speculators' Arrow rows hold)."""
    position: Any = None
    """Online: where the sample's ready event lies in Kafka (``hsx.trainer.offsets.Position``)."""

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])


def loss_mask(shard: Any, event: HiddenStatesReady, policy: LossMaskPolicy) -> torch.Tensor:
    """The stored mask (chats: the assistant's tokens), or ``policy``'s for a
    sample stored without one, as int64 ``[T]``."""
    stored = read_loss_mask(shard, event)
    if stored is not None:
        return stored.to(torch.int64)
    fill = torch.ones if policy == "all" else torch.zeros
    return fill(event.num_tokens, dtype=torch.int64)


def check_trainable(event: HiddenStatesReady) -> None:
    """Refuse what no EAGLE-3 trainer can use, in one line."""
    if event.capture == "last":
        raise ValueError(f"sample {event.request_id} holds the last token's hidden states only (capture: last); "
                         "training needs every token's")


def read_sample(shard: Any, event: HiddenStatesReady, layout: LayerLayout, policy: LossMaskPolicy,
                mask: torch.Tensor | None = None) -> TrainingSample:
    """Read one sample from its open shard (``safe_open``: only its own bytes are
    read from the memory map). ``mask``: its loss mask, when already read."""
    check_trainable(event)
    names = event.tensors
    # A remote shard: the tensors read below in one round of requests (only those, or
    # prefetched bytes would wait for a read that never comes).
    prefetch(shard, [names.hidden_states, names.token_ids]
             + ([names.loss_mask] if mask is None and names.loss_mask else []))
    if tuple(event.layer_ids) != layout.stored:
        raise ValueError(f"sample {event.request_id} stores layers {event.layer_ids}, "
                         f"not the {list(layout.stored)} the loader was set up for")
    indices = layout.indices
    if indices == list(range(len(layout.stored))):
        hidden = read_hidden_states(shard, event)
    elif event.codec is DatasetCodec.RAW:  # only the chosen layers' rows are copied out of the map
        check_raw(shard, event)
        view = shard.get_slice(event.tensors.hidden_states)
        hidden = torch.stack([view[:, i] for i in indices], dim=1)
    else:  # an encoded sample decodes whole
        hidden = read_hidden_states(shard, event)[:, indices].contiguous()
    return TrainingSample(request_id=event.request_id, input_ids=read_token_ids(shard, event),
                          hidden_states=hidden, loss_mask=loss_mask(shard, event, policy) if mask is None else mask)
