"""``hsx export --format speculators OUT``: the per-sample layout the
`speculators` EAGLE-3 trainer (v0.5+) reads offline.

    OUT/                      an Arrow dataset (datasets.save_to_disk): input_ids, loss_mask, seq_len
    OUT/hidden_states/hs_<row>.safetensors   {"hidden_states": [T, L, H], "token_ids": int64 [T]}

The trainer feeds slots ``0..L-2`` to its fusion layer and uses slot ``L-1`` as
the verifier's last hidden state (it applies the final norm itself), so the
exported layers must end with the last layer's pre-norm output: hsx's layer id
``num_hidden_layers``, which the default layer set includes. Samples that were
not chats get a loss mask of ones (train on every token). A sample whose answer
the verifier generated is exported as the regenerated conversation, its loss
mask on the generated tokens; samples that kept the last token's hidden states
only (``capture: last``) cannot be exported.
"""

from __future__ import annotations

import argparse
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from runtime.checks import existing_dir, new_dir, outside
from runtime.errors import UsageError
from sink.inspect import DATASET
from sink.reader import open_dataset
from sink.shards import INDEX


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("out", type=Path, help="output directory (must not exist)")
    parser.add_argument("--dataset", type=Path, required=True, help="the dataset written by hsx sink")
    parser.add_argument("--format", choices=["speculators"], default="speculators", help="target layout")


def _loss_mask(sample: dict[str, Any]) -> torch.Tensor:
    mask = sample["loss_mask"]
    return torch.ones_like(sample["token_ids"]) if mask is None else mask.to(torch.int64)


def _rows(dataset_path: str) -> Iterator[dict[str, Any]]:
    # Module-level and fed a path: `datasets` pickles the generator to fingerprint it.
    dataset = open_dataset(dataset_path)
    for request_id in dataset.request_ids():
        sample = dataset[request_id]
        yield {"input_ids": sample["token_ids"].tolist(), "loss_mask": _loss_mask(sample).tolist(),
               "seq_len": int(sample["token_ids"].shape[0])}


def export_speculators(dataset_path: Path, out: Path) -> int:
    """Write ``out`` from the dataset at ``dataset_path`` (row i ↔ ``hs_i``, in
    index order); returns the number of rows."""
    from datasets import Dataset as ArrowDataset

    dataset = open_dataset(dataset_path)
    if not len(dataset):
        raise UsageError(f"--dataset {dataset_path}: holds no samples yet")
    last_only = [r for r in dataset.request_ids() if dataset.event(r).capture == "last"]
    if last_only:
        raise UsageError(f"--dataset {dataset_path}: {len(last_only)} samples (e.g. {last_only[0]}) hold the last "
                         "token's hidden states only (capture: last); speculators trains on every token's")
    (out / "hidden_states").mkdir(parents=True)
    for row, request_id in enumerate(dataset.request_ids()):
        sample = dataset[request_id]
        save_file({"hidden_states": sample["hidden_states"].contiguous(), "token_ids": sample["token_ids"]},
                  str(out / "hidden_states" / f"hs_{row}.safetensors"))
    with tempfile.TemporaryDirectory() as cache:
        arrow = ArrowDataset.from_generator(_rows, gen_kwargs={"dataset_path": str(dataset_path)}, cache_dir=cache)
        arrow.set_format(type="torch")  # the trainer compares rows with torch.equal
        arrow.save_to_disk(str(out))
    return len(dataset)


def run(args: argparse.Namespace) -> int:
    existing_dir("--dataset", args.dataset, INDEX, DATASET)
    new_dir("OUT", args.out)
    outside("OUT", args.out, "--dataset", args.dataset)
    count = export_speculators(args.dataset, args.out)
    print(f"exported {count} samples to {args.out} (speculators layout)")
    return 0
