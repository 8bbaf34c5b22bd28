"""The exports two arms of the acceptance benchmark train on, made from hsx's
export (speculators' layout: an Arrow dataset of ``input_ids``, ``loss_mask``
and ``seq_len`` rows, and ``hidden_states/hs_<row>.safetensors`` holding
``hidden_states [T, L, H]`` and ``token_ids [T]``):

* the reference: the same rows, every hidden state recomputed by HF
  transformers and written here, with none of ``hsx export``'s code;
* the shifted control: hsx's hidden states one position late.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

HIDDEN_STATES = "hidden_states"


def _copy_rows(source: Path, out: Path, rewrite: Callable[[int, dict[str, torch.Tensor]], torch.Tensor]) -> None:
    """``out``: ``source`` with each row's hidden states replaced by
    ``rewrite(row, tensors)``; the rows' tokens, masks and counts unchanged.
    ``hsx_export.json`` is written last, so a stopped copy is not mistaken for a done one."""
    if out.exists():
        shutil.rmtree(out)
    shutil.copytree(source, out, ignore=shutil.ignore_patterns(HIDDEN_STATES, "hsx_export.json", "d2t-*", "t2d-*"))
    (out / HIDDEN_STATES).mkdir()
    files = sorted((source / HIDDEN_STATES).glob("hs_*.safetensors"), key=lambda p: int(p.stem.removeprefix("hs_")))
    for i, path in enumerate(files):
        tensors = load_file(str(path))
        hidden = rewrite(int(path.stem.removeprefix("hs_")), tensors)
        assert hidden.shape == tensors["hidden_states"].shape, (path, hidden.shape)
        save_file({"hidden_states": hidden.to(tensors["hidden_states"].dtype).contiguous(),
                   "token_ids": tensors["token_ids"]}, str(out / HIDDEN_STATES / path.name))
        if i % 200 == 0:
            print(f"[acceptance] {out.name}: {i}/{len(files)} rows", flush=True)
    shutil.copy2(source / "hsx_export.json", out / "hsx_export.json")


def write_shifted_export(source: Path, out: Path) -> None:
    """Position t holds position t-1's hidden states (the first keeps its own):
    the off-by-one a trainer's reader or an extractor could make."""
    def shift(_row: int, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
        hidden = tensors["hidden_states"]
        return torch.cat([hidden[:1], hidden[:-1]])

    _copy_rows(source, out, shift)


def write_reference_export(source: Path, out: Path, model: Path) -> None:
    """Every row's hidden states from HF transformers (float32, then the
    export's dtype) for the rows' own ``input_ids``, at the export's layer ids
    (vLLM's convention, :class:`hsx.reference.HFReference`)."""
    import datasets

    from hsx.reference import HFReference

    rows = datasets.load_from_disk(str(source))
    layer_ids = json.loads((source / "hsx_export.json").read_text())["layer_ids"]
    reference = HFReference(model)

    def recompute(row: int, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
        input_ids = list(rows[row]["input_ids"])
        if input_ids != tensors["token_ids"].tolist():
            raise ValueError(f"row {row}: hsx_export's token_ids differ from its Arrow row's input_ids")
        return reference.hidden_states(input_ids, layer_ids)

    _copy_rows(source, out, recompute)
