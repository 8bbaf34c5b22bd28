"""Draft checkpoints read and checked against a verifier before any engine
starts (``hsx eval-draft --draft``). The checkpoints are written here in
speculators' layout: its ``config.json`` fields and a safetensors file holding
the input projection ``fc.weight``."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from safetensors.numpy import save_file

from hsx.runtime.draft_checkpoint import check_verifier, read_draft
from hsx.runtime.draft_types import TYPES
from hsx.runtime.errors import UsageError

VERIFIER = SimpleNamespace(hidden_size=128, vocab_size=1000, num_hidden_layers=4)
"""tiny-llama's sizes."""


def write_draft(path: Path, hidden: int = 128, vocab: int = 1000, aux: list[int] | None = None,
                fc_inputs: int | None = None, kind: str = "eagle3", weights: bool = True) -> Path:
    """A draft checkpoint as speculators saves one (a draft hidden size of 128 and
    aux layers [1, 2, 3] unless told), for ``hidden`` and ``vocab`` of its verifier."""
    aux = [1, 2, 3] if aux is None else aux
    path.mkdir(parents=True)
    aux_key = TYPES[kind].aux_key if kind in TYPES else "eagle_aux_hidden_state_layer_ids"
    (path / "config.json").write_text(json.dumps({
        "speculators_model_type": kind, "draft_vocab_size": 64, aux_key: aux,
        "target_hidden_size": hidden,
        "transformer_layer_config": {"hidden_size": 128, "vocab_size": vocab, "model_type": "llama"},
        "speculators_config": {"verifier": {"name_or_path": f"verifier-{hidden}x{vocab}"}}}))
    if weights:
        save_file({"fc.weight": np.zeros((128, fc_inputs or len(aux) * hidden), np.float32)},
                  str(path / "model.safetensors"))
    return path


def test_a_draft_for_the_verifier_passes(tmp_path: Path) -> None:
    draft = read_draft("--draft", write_draft(tmp_path / "d"))
    assert (draft.aux_layer_ids, draft.target_hidden_size, draft.vocab_size, draft.fc_shape) == (
        [1, 2, 3], 128, 1000, (128, 384))
    check_verifier("--draft", draft, VERIFIER)


@pytest.mark.parametrize(("make", "phrase"), [
    (lambda p: p / "missing", "no such directory"),
    (lambda p: p.mkdir() or p, "no config.json, so not a draft checkpoint"),
    (lambda p: write_draft(p, kind="mtp"), "config.json's speculators_model_type is 'mtp': MTP drafts are trained on "
                                           "the verifier's own multi-token-prediction layers"),
    (lambda p: write_draft(p, kind="medusa"), "speculators_model_type is 'medusa'; this takes EAGLE-3, DFlash or "
                                              "P-EAGLE checkpoints"),
    (lambda p: write_draft(p, kind="dflash", aux=[]), "aux_hidden_state_layer_ids must be a list of layer ids, got []"),
    (lambda p: write_draft(p, weights=False), "no *.safetensors weights beside config.json"),
    (lambda p: write_draft(p, aux=[1, -2]), "eagle_aux_hidden_state_layer_ids must be a list of layer ids"),
])
def test_what_is_not_a_draft_is_one_line(tmp_path: Path, make, phrase: str) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(UsageError) as info:
        read_draft("--draft", make(tmp_path / "d"))
    assert phrase in str(info.value) and str(info.value).startswith("--draft ")


def test_vllm_counts_aux_layers_from_the_model_config_not_the_layer_ids(tmp_path: Path) -> None:
    """vLLM sizes the draft's input projection from the model config's
    num_aux_hidden_states or eagle_config (3 without either): a draft that
    sets one of them for its 2 aux layers loads."""
    for i, layer_config in enumerate(({"num_aux_hidden_states": 2},
                                      {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 3]}})):
        path = write_draft(tmp_path / str(i), aux=[1, 3])
        config = json.loads((path / "config.json").read_text())
        config["transformer_layer_config"].update(layer_config)
        (path / "config.json").write_text(json.dumps(config))
        draft = read_draft("--draft", path)
        assert draft.served_aux_count == 2
        check_verifier("--draft", draft, VERIFIER)


def test_dflash_drafts_are_sized_by_their_own_layer_ids(tmp_path: Path) -> None:
    """vLLM's DFlash layers (and its qwen3 EAGLE-3 ones) count the draft's own
    aux layer ids, unlike its llama EAGLE-3 layers."""
    draft = read_draft("--draft", write_draft(tmp_path / "d", kind="dflash", aux=[1, 3]))
    assert draft.kind.name == "dflash" and draft.aux_layer_ids == [1, 3] and draft.served_aux_count == 2
    check_verifier("--draft", draft, VERIFIER)


def test_a_command_that_serves_eagle3_only_names_what_it_takes(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="speculators_model_type is 'dflash'; this takes EAGLE-3 checkpoints"):
        read_draft("--draft", write_draft(tmp_path / "d", kind="dflash"), ("eagle3",))


def test_aux_layers_out_of_layer_order_are_refused(tmp_path: Path) -> None:
    """vLLM hands a draft the aux hidden states in layer order, not the config's."""
    with pytest.raises(UsageError, match=r"eagle_aux_hidden_state_layer_ids \[3, 1, 2\] are not ascending: the engine"):
        read_draft("--draft", write_draft(tmp_path / "d", aux=[3, 1, 2]))


def test_a_damaged_weights_file_is_one_line(tmp_path: Path) -> None:
    path = write_draft(tmp_path / "d")
    (path / "model.safetensors").write_bytes(b"\xff" * 64)
    with pytest.raises(UsageError, match="not a readable safetensors file"):
        read_draft("--draft", path)


@pytest.mark.parametrize(("kwargs", "phrase"), [
    ({"hidden": 64}, "it expects hidden size 64, the model has 128"),
    ({"vocab": 49152}, "its vocabulary is 49152 tokens, the model's 1000"),
    ({"aux": [1, 2, 4]}, "its aux layer ids [1, 2, 4] go past the model's 4 layers (0..3)"),
    ({"fc_inputs": 256}, "its fc.weight takes 256 inputs; the engine builds it for 384 (3 aux layers x 128"),
    ({"aux": [1, 3]}, "its fc.weight takes 256 inputs; the engine builds it for 384 (3 aux layers x 128"),
])
def test_a_draft_for_another_verifier_is_refused(tmp_path: Path, kwargs: dict[str, object], phrase: str) -> None:
    draft = read_draft("--draft", write_draft(tmp_path / "d", **kwargs))  # type: ignore[arg-type]
    with pytest.raises(UsageError) as info:
        check_verifier("--draft", draft, VERIFIER)
    assert phrase in str(info.value) and "is not a draft for this model (built for verifier-" in str(info.value)
