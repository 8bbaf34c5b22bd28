"""Draft checkpoints as files (speculators' layout: ``config.json`` and
``*.safetensors``), and what makes one a drop-in for another: what a server
checks before it swaps a promoted draft in (``hsx.extractor.connector.draft_swap``)
and a gate before it promotes one (``hsx.trainer.gate``); where promoted drafts
are published is :mod:`hsx.dataset.draft_store`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open


CONFIG_KEYS = ("speculators_model_type", "eagle_aux_hidden_state_layer_ids", "draft_vocab_size", "target_hidden_size")
"""``config.json`` fields a drop-in has the same as the draft it replaces."""
LAYER_KEYS = ("hidden_size", "vocab_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
              "intermediate_size")
"""... and of its ``transformer_layer_config``."""


class DraftRefused(Exception):
    """A checkpoint the server will not swap in; the message says why."""


def checked_tensors(path: Path, served_config: dict[str, Any],
                    served_shapes: dict[str, tuple[int, ...]]) -> dict[str, torch.Tensor]:
    """The tensors of the checkpoint at ``path`` when it is a drop-in for the
    draft whose ``config.json`` and tensor shapes are given (the same layers,
    vocabulary and sizes, the same tensors and shapes, all finite); else
    :class:`DraftRefused` naming the first difference."""
    config = read_config(path)
    for key in CONFIG_KEYS:
        if config.get(key) != served_config.get(key):
            raise DraftRefused(f"config.json's {key} is {config.get(key)!r}, the served draft's "
                               f"{served_config.get(key)!r}")
    layer, served_layer = config["transformer_layer_config"], served_config["transformer_layer_config"]
    for key in LAYER_KEYS:
        if layer.get(key) != served_layer.get(key):
            raise DraftRefused(f"transformer_layer_config's {key} is {layer.get(key)!r}, the served draft's "
                               f"{served_layer.get(key)!r}")
    tensors = _load_tensors(path)
    shapes = {name: tuple(t.shape) for name, t in tensors.items()}
    if shapes != served_shapes:
        missing, extra = sorted(set(served_shapes) - set(shapes)), sorted(set(shapes) - set(served_shapes))
        changed = sorted(n for n in set(shapes) & set(served_shapes) if shapes[n] != served_shapes[n])
        raise DraftRefused(f"its tensors are not the served draft's: missing {missing[:4]}, extra {extra[:4]}, "
                           f"other shapes {[(n, shapes[n], served_shapes[n]) for n in changed[:4]]}")
    for name, tensor in tensors.items():
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            raise DraftRefused(f"{name} holds NaN or inf")
    return tensors


def read_config(path: Path) -> dict[str, Any]:
    try:
        config = json.loads((path / "config.json").read_text())
    except FileNotFoundError:
        raise DraftRefused(f"{path} has no config.json") from None
    except (OSError, ValueError) as exc:
        raise DraftRefused(f"{path}/config.json does not read as JSON: {exc}") from None
    if not isinstance(config, dict) or not isinstance(config.get("transformer_layer_config"), dict):
        raise DraftRefused(f"{path}/config.json is not a speculators draft's (no transformer_layer_config)")
    return config


def _weight_files(path: Path) -> list[Path]:
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise DraftRefused(f"{path} has no *.safetensors weights")
    return files


def tensor_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """Tensor names and shapes from the headers alone."""
    shapes = {}
    for file in _weight_files(path):
        with safe_open(file, "pt") as tensors:
            for name in tensors.keys():  # noqa: SIM118 (safe_open has keys(), no __iter__)
                shapes[name] = tuple(tensors.get_slice(name).get_shape())
    return shapes


def _load_tensors(path: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for file in _weight_files(path):
        with safe_open(file, "pt") as opened:
            for name in opened.keys():  # noqa: SIM118
                tensors[name] = opened.get_tensor(name)
    return tensors

