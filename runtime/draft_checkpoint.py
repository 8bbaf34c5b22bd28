"""A draft checkpoint as speculators saves it (``config.json`` with its
``speculators_model_type``, one of :mod:`hsx.runtime.draft_types`, weights in
``*.safetensors``), read without loading a tensor, and checked against the
verifier it is to draft for: the mistakes that vLLM would otherwise report
minutes later, in a traceback."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from safetensors import SafetensorError, safe_open

from hsx.runtime.draft_types import REFUSED, TYPES, DraftType
from hsx.runtime.errors import UsageError
from hsx.schemas.training import SERVED_AUX_LAYERS

FC = "fc.weight"
"""The projection of the verifier's concatenated aux hidden states: ``[hidden, len(aux) x verifier hidden]``."""


@dataclass(frozen=True)
class DraftCheckpoint:
    """What a draft checkpoint says about the verifier it was built for."""

    path: Path
    kind: DraftType
    aux_layer_ids: list[int] | None
    """The verifier layers whose hidden states feed the draft (vLLM's ids: the
    input of decoder layer L); None where vLLM's default applies."""
    target_hidden_size: int
    """The verifier's hidden size the draft expects."""
    vocab_size: int
    """The verifier's vocabulary (the draft's embedding)."""
    draft_vocab_size: int
    verifier: str | None
    """The verifier's name or path as the checkpoint records it (informational)."""
    fc_shape: tuple[int, ...] | None
    served_aux_count: int
    """How many aux hidden states vLLM builds the draft's input projection for.
    Its llama EAGLE-3 layers (``eagle3`` and ``peagle`` drafts of llama layers)
    read ``num_aux_hidden_states``, else the length of ``eagle_config``'s layer
    ids, else 3, from the ``transformer_layer_config`` its speculators-format
    loader starts from: vLLM (0.32) does not count the top-level
    ``eagle_aux_hidden_state_layer_ids`` that speculators writes there, so such a
    draft with other than 3 aux layers does not load. Its qwen3 and DFlash
    layers count the draft's own layer ids."""


def read_draft(flag: str, value: str | Path, types: tuple[str, ...] = tuple(TYPES)) -> DraftCheckpoint:
    """The checkpoint in directory ``value``; :class:`UsageError` naming ``flag``
    for a missing directory or files, or a directory that is not a draft of one
    of ``types``."""
    path = Path(value)
    titles = [TYPES[t].title for t in types]
    wanted = " or ".join(filter(None, [", ".join(titles[:-1]), titles[-1]]))
    if not path.is_dir():
        raise UsageError(f"{flag} {value}: no such directory (a draft checkpoint: config.json and *.safetensors)")
    config_file = path / "config.json"
    try:
        config = json.loads(config_file.read_text())
    except FileNotFoundError:
        raise UsageError(f"{flag} {value}: no config.json, so not a draft checkpoint") from None
    except (OSError, ValueError) as exc:
        raise UsageError(f"{flag} {value}: config.json does not read as JSON: {exc}") from None
    name = config.get("speculators_model_type") if isinstance(config, dict) else None
    if name not in types:
        why = f": {REFUSED[name]}" if name in REFUSED else ""
        raise UsageError(f"{flag} {value}: config.json's speculators_model_type is {name!r}{why}; this takes "
                         f"{wanted} checkpoints ({', '.join(types)}: `speculators train` or `hsx train-draft` "
                         "saves them)")
    kind = TYPES[name]
    layer = config.get("transformer_layer_config")
    if not isinstance(layer, dict) or not _count(layer.get("hidden_size")) or not _count(layer.get("vocab_size")):
        raise UsageError(f"{flag} {value}: config.json has no transformer_layer_config with hidden_size and vocab_size")
    weights = sorted(path.glob("*.safetensors"))
    if not weights:
        raise UsageError(f"{flag} {value}: no *.safetensors weights beside config.json")
    aux = config.get(kind.aux_key)
    listed = isinstance(aux, list) and aux and all(_count(i, 0) for i in aux)
    if (aux is not None or not kind.eagle3_layers) and not listed:
        raise UsageError(f"{flag} {value}: {kind.aux_key} must be a list of layer ids, got {aux!r}")
    if aux is not None and aux != sorted(aux):
        raise UsageError(f"{flag} {value}: {kind.aux_key} {aux} are not ascending: the engine "
                         "hands a draft the verifier's aux hidden states in layer order, so this draft would see "
                         "them in another order than it was trained on; train it with ascending layer ids")
    target = config.get("target_hidden_size")
    verifier = _nested(config, "speculators_config", "verifier", "name_or_path")
    return DraftCheckpoint(
        path=path, kind=kind, aux_layer_ids=aux, target_hidden_size=target if _count(target) else layer["hidden_size"],
        vocab_size=layer["vocab_size"], draft_vocab_size=config.get("draft_vocab_size") or layer["vocab_size"],
        verifier=verifier if isinstance(verifier, str) else None, fc_shape=_fc_shape(flag, weights),
        served_aux_count=_served_aux_count(kind, layer, aux))


def check_verifier(flag: str, draft: DraftCheckpoint, verifier: Any) -> None:
    """:class:`UsageError` unless ``draft`` fits ``verifier`` (a model's text
    config): its hidden size and vocabulary, aux layer ids within its layers,
    and the draft's input projection sized for them."""
    problems = []
    if draft.target_hidden_size != verifier.hidden_size:
        problems.append(f"it expects hidden size {draft.target_hidden_size}, the model has {verifier.hidden_size}")
    if draft.vocab_size != verifier.vocab_size:
        problems.append(f"its vocabulary is {draft.vocab_size} tokens, the model's {verifier.vocab_size}")
    layers = verifier.num_hidden_layers
    if draft.aux_layer_ids is not None and max(draft.aux_layer_ids) >= layers:
        problems.append(f"its aux layer ids {draft.aux_layer_ids} go past the model's {layers} layers (0..{layers - 1})")
    served = draft.served_aux_count * verifier.hidden_size
    if draft.fc_shape is not None and draft.fc_shape[-1] != served:
        problems.append(f"its {FC} takes {draft.fc_shape[-1]} inputs; the engine builds it for {served} "
                        f"({draft.served_aux_count} aux layers x {verifier.hidden_size}: the count it reads from "
                        "num_aux_hidden_states or eagle_config, 3 when neither is set, as in speculators' checkpoints)")
    if problems:
        built_for = f" (built for {draft.verifier})" if draft.verifier else ""
        raise UsageError(f"{flag} {draft.path} is not a draft for this model{built_for}: " + "; ".join(problems))


def _served_aux_count(kind: DraftType, config: dict[str, Any], aux: list[int] | None) -> int:
    """vLLM's rule (:attr:`DraftCheckpoint.served_aux_count`) for a draft of
    ``kind`` with the model config ``config`` and aux layer ids ``aux``."""
    if kind.eagle3_layers and config.get("model_type", "llama") == "llama":
        return _llama_eagle3_aux_count(config)
    return len(aux) if aux else SERVED_AUX_LAYERS


def _llama_eagle3_aux_count(config: dict[str, Any]) -> int:
    """``llama_eagle3``'s count: ``num_aux_hidden_states``, else the length of
    ``eagle_config.eagle_aux_hidden_state_layer_ids``, else 3."""
    count = config.get("num_aux_hidden_states")
    if _count(count):
        return int(count)  # type: ignore[arg-type]
    ids = _nested(config, "eagle_config", "eagle_aux_hidden_state_layer_ids")
    return len(ids) if isinstance(ids, list) and ids else SERVED_AUX_LAYERS


def _fc_shape(flag: str, weights: list[Path]) -> tuple[int, ...] | None:
    """The shape of the draft's input projection, from the safetensors headers."""
    for file in weights:
        try:
            with safe_open(file, "pt") as tensors:
                if FC in tensors.keys():  # noqa: SIM118 (safe_open has keys(), no __contains__)
                    return tuple(tensors.get_slice(FC).get_shape())
        except (SafetensorError, OSError) as exc:
            raise UsageError(f"{flag} {file}: not a readable safetensors file: {exc}") from None
    return None


def _nested(config: dict[str, Any], *keys: str) -> object:
    """``config[k1][k2]...``, or None where any level is missing or not an object."""
    value: object = config
    for key in keys:
        value = value.get(key) if isinstance(value, dict) else None
    return value


def _count(value: object, least: int = 1) -> bool:
    """``value`` is an integer (not a bool) of at least ``least``."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= least
