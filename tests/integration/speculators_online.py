"""Run with .venv-speculators' python: speculators' own online training data path
(``speculators.train.data.ArrowDataset`` with ``on_missing="generate"``, what
``speculators train --on-missing generate --vllm-endpoint URL`` builds) against a
vLLM server, without its trainer (which needs an accelerator).

    speculators_online.py URL WORK_DIR ROWS_JSON OUT.safetensors

ROWS_JSON is a list of token id lists: saved as speculators' Arrow layout
(``input_ids``, ``loss_mask``, ``seq_len``) in WORK_DIR/data; no hidden-states file
exists, so every sample is generated through the server and read back by
``FileTransfer``. Each item's ``hidden_states`` (the aux layers, flattened),
``verifier_last_hidden_states`` and ``input_ids`` go into OUT as ``<i>/<name>``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from datasets import Dataset
from safetensors.torch import save_file
from speculators.train.data import ArrowDataset


def main() -> None:
    url, work, rows, out = sys.argv[1], Path(sys.argv[2]), json.loads(sys.argv[3]), Path(sys.argv[4])
    data = work / "data"
    arrow = Dataset.from_dict({"input_ids": rows, "loss_mask": [[1] * len(r) for r in rows],
                               "seq_len": [len(r) for r in rows]})
    arrow.set_format(type="torch")  # as speculators' own data generation leaves it (and hsx export)
    arrow.save_to_disk(str(data))
    dataset = ArrowDataset(max_len=4096, datapath=data, vllm_endpoint=f"{url}/v1", on_missing="generate",
                           hidden_states_dtype=torch.float32)
    tensors = {}
    for i in range(len(dataset)):
        item = dataset[i]
        if not isinstance(item, dict):
            raise SystemExit(f"row {i}: {item}")
        for name in ("hidden_states", "verifier_last_hidden_states", "input_ids"):
            tensors[f"{i}/{name}"] = torch.as_tensor(item[name]).contiguous()
    save_file(tensors, str(out))


if __name__ == "__main__":
    main()
