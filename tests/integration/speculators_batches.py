"""Run under .venv-speculators (speculators 0.9.0), never imported by hsx's tests:
speculators' own ArrowDataset and CollateFn over an hsx export, each batch's
tensors written to one safetensors file for the test to compare with hsx's, and
speculators' own token_freq.pt of the export's rows.

    python speculators_batches.py EXPORT OUT_DIR SPEC_JSON
    SPEC_JSON: {"total_seq_len": 64, "dtype": "bfloat16", "hidden_size": 16, "batches": [[0, 1], [2]]}
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from datasets import load_from_disk
from safetensors.torch import save_file
from speculators.train.data import ArrowDataset, CollateFn
from speculators.train.vocab_mapping import save_token_frequency_distribution


def main() -> None:
    export, out, spec = Path(sys.argv[1]), Path(sys.argv[2]), json.loads(sys.argv[3])
    dtype = getattr(torch, spec["dtype"])
    dataset = ArrowDataset(max_len=spec["total_seq_len"], datapath=str(export), on_missing="raise",
                           train_ratio=1.0, hidden_states_dtype=dtype)
    num_aux = len(json.loads((export / "hsx_export.json").read_text())["aux_layer_ids"])
    collate = CollateFn(spec["total_seq_len"], spec["hidden_size"], num_target_layers=num_aux, dtype=dtype)
    tensors: dict[str, torch.Tensor] = {}
    for b, rows in enumerate(spec["batches"]):
        batch = collate([dataset[i] for i in rows])
        for key, value in batch.items():
            tensors[f"{b}/{key}"] = value if isinstance(value, torch.Tensor) else torch.tensor(value)
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "batches.safetensors"))
    save_token_frequency_distribution(load_from_disk(str(export)), out / "token_freq.pt")
    print(f"{len(spec['batches'])} batches of {len(dataset)} rows")


if __name__ == "__main__":
    main()
