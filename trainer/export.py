"""``hsx export --format speculators [--speculator-type T] OUT``: the offline
layout of speculators' trainer (0.5+, checked against 0.9.0), which every draft
type hsx feeds reads (:mod:`hsx.runtime.draft_types`: EAGLE-3, DFlash, P-EAGLE;
the type only changes the printed train command)::

    OUT/                                     Arrow dataset (datasets.save_to_disk): input_ids, loss_mask, seq_len
    OUT/hidden_states/hs_<row>.safetensors   {"hidden_states": [T, L, H], "token_ids": int64 [T]}
    OUT/token_freq.pt                        {token id: count} of the tokens under loss_mask == 1
    OUT/hsx_export.json                      hsx.schemas.training.ExportMetadata: model, layer ids per slot, ...

The trainer feeds slots ``0..L-2`` to its fusion layer and uses slot ``L-1`` as
the verifier's last hidden state (it applies the final norm itself), so the last
slot is always the highest stored layer, hsx's ``num_hidden_layers`` (the last
layer's pre-norm output, in the default layer set). ``--layers`` picks the aux
slots in a draft config's order. Rows are the trainable samples in index order:
samples without a supervised token are dropped, as speculators' own data
preparation drops them, and counted. A sample whose answer the verifier
generated is exported as the regenerated conversation, its mask on the
generated tokens; ``capture: last`` samples cannot be exported. Hidden states are
written decoded, in the dtype the sink received: a ``byteplane-zstd`` sample
bit-exact, an ``fp8`` one dequantized (bf16 for a bf16 model), so a dataset whose
codec changed between sink runs exports in one dtype.
"""

from __future__ import annotations

import argparse
import tempfile
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from hsx.dataset.inspect import DATASET
from hsx.dataset.shards import INDEX
from hsx.dataset.storage import is_object_store
from hsx.runtime.checks import existing_dir, new_dir, outside
from hsx.runtime.draft_types import REFUSED, TYPES, draft_type
from hsx.runtime.errors import UsageError
from hsx.schemas.training import ExportMetadata, LossMaskPolicy, SpeculatorType
from hsx.trainer.dataset import HsxDataset
from hsx.trainer.samples import layer_list

METADATA = "hsx_export.json"
TOKEN_FREQ = "token_freq.pt"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("out", type=Path, help="output directory (must not exist)")
    parser.add_argument("--dataset", required=True, help="the dataset written by hsx sink (a directory or "
                                                         "s3://bucket/prefix)")
    parser.add_argument("--format", choices=["speculators"], default="speculators", help="target layout")
    parser.add_argument("--speculator-type", default="eagle3", metavar="TYPE",
                        help=f"the draft type the printed train command trains: {', '.join(TYPES)} (default "
                             f"%(default)s; {', '.join(REFUSED)} are refused with the reason)")
    parser.add_argument("--layers", type=layer_list, default=None,
                        help="aux layer ids in slot order, as the draft's target_layer_ids, e.g. 2,15,27 "
                             "(default: every stored layer but the last, ascending); the last slot is always "
                             "the highest stored layer")
    parser.add_argument("--loss-mask", choices=["all", "none"], default="all",
                        help="loss mask of samples stored without one (plain text, not chats): all = train on "
                             "every token, none = no token (such rows are dropped); default all")
    parser.add_argument("--verifier", metavar="PATH_OR_ID",
                        help="the model the dataset was extracted with, as speculators loads it (a local directory "
                             "or a hub id), for the printed train command (default: the recorded model name, "
                             "where that is a directory)")


def _open(dataset_path: str | Path, layers: list[int] | None, policy: LossMaskPolicy) -> HsxDataset:
    try:
        return HsxDataset(dataset_path, layers=layers, loss_mask=policy)
    except ValueError as exc:
        raise UsageError(f"--dataset {dataset_path}: {exc}") from None


def _rows(dataset_path: str, layers: tuple[int, ...] | None, policy: LossMaskPolicy) -> Iterator[dict[str, Any]]:
    # Module-level and fed plain values: `datasets` pickles the generator to fingerprint it,
    # and splits list arguments into shards (so the layers come as a tuple).
    dataset = _open(dataset_path, None if layers is None else list(layers), policy)
    for row in range(len(dataset)):
        ids, mask = dataset.tokens(row)
        yield {"input_ids": ids.tolist(), "loss_mask": mask.tolist(), "seq_len": int(ids.shape[0])}


def token_frequencies(pairs: Iterator[tuple[torch.Tensor, torch.Tensor]]) -> dict[int, int]:
    """``{token id: count}`` over the tokens whose mask is 1, each row counted
    in turn: the dict speculators' ``save_token_frequency_distribution`` saves."""
    counts: Counter[int] = Counter()
    for input_ids, mask in pairs:
        ids, n = input_ids[mask.to(torch.bool)].unique(return_counts=True)
        counts.update(dict(zip(ids.tolist(), n.tolist(), strict=True)))
    return dict(counts)


def export_speculators(dataset_path: str | Path, out: Path, layers: list[int] | None = None,
                       policy: LossMaskPolicy = "all", speculator_type: SpeculatorType = "eagle3") -> ExportMetadata:
    """Write ``out`` from the dataset at ``dataset_path``; returns what
    ``hsx_export.json`` says."""
    from datasets import Dataset as ArrowDataset

    dataset = _open(dataset_path, layers, policy)
    if not len(dataset):
        raise UsageError(f"--dataset {dataset_path}: no sample has a supervised token "
                         f"({dataset.dropped} dropped; plain-text samples need --loss-mask all)")
    (out / "hidden_states").mkdir(parents=True)
    pairs = []
    for row in range(len(dataset)):
        sample = dataset[row]
        save_file({"hidden_states": sample.hidden_states.contiguous(), "token_ids": sample.input_ids},
                  str(out / "hidden_states" / f"hs_{row}.safetensors"))
        pairs.append((sample.input_ids, sample.loss_mask))
    freq = token_frequencies(iter(pairs))
    torch.save(freq, out / TOKEN_FREQ)
    with tempfile.TemporaryDirectory() as cache:
        arrow = ArrowDataset.from_generator(_rows, cache_dir=cache, gen_kwargs={
            "dataset_path": str(dataset_path), "layers": None if layers is None else tuple(layers), "policy": policy})
        arrow.set_format(type="torch")  # the trainer compares rows with torch.equal
        arrow.save_to_disk(str(out))
    first = dataset.event(0)
    metadata = ExportMetadata(
        model=first.model, layer_ids=list(dataset.layout.slots), aux_layer_ids=list(dataset.layout.aux),
        verifier_layer_id=dataset.layout.verifier, dtype=first.dtype, hidden_size=first.hidden_size,
        rows=len(dataset), dropped_unsupervised=dataset.dropped, loss_mask=policy,
        supervised_tokens=sum(freq.values()), speculator_type=speculator_type)
    (out / METADATA).write_text(metadata.model_dump_json(indent=2) + "\n")
    return metadata


VERIFIER_PLACEHOLDER = "VERIFIER"
GPU_SEQ_LEN = 8192
CPU_SEQ_LEN = 2048
"""Tokens a training batch packs: speculators' usual 8,192 on an accelerator; on a
CPU one such step over 15 SmolLM2 samples had not ended after 20 minutes on two
cores, where 2,048 took five and a half."""


def train_command(out: Path, metadata: ExportMetadata, verifier: str | None = None,
                  total_seq_len: int = GPU_SEQ_LEN) -> str:
    """The ``speculators train`` command line for an export (README: Training on
    hsx data). The dataset records the model's name (``hsx extract --model-name``,
    by default its directory's name), which speculators cannot load unless it is
    a directory: then :data:`VERIFIER_PLACEHOLDER` stands where ``verifier`` goes.
    ``total_seq_len``: the tokens a batch packs (:data:`CPU_SEQ_LEN` on a CPU)."""
    dtype = "float32" if metadata.dtype.value == "float32" else "bfloat16"
    verifier = verifier or (metadata.model if Path(metadata.model).is_dir() else VERIFIER_PLACEHOLDER)
    return (f"speculators train --speculator-type {metadata.speculator_type} --verifier-name-or-path {verifier} "
            f"--data-path {out} --target-layer-ids {' '.join(map(str, metadata.aux_layer_ids))} "
            f"--hidden-states-dtype {dtype} --on-missing raise --total-seq-len {total_seq_len} "
            f"--draft-vocab-size 32000")


def run(args: argparse.Namespace) -> int:
    kind = draft_type("--speculator-type", args.speculator_type)
    new_dir("OUT", args.out)
    if not is_object_store(args.dataset):
        existing_dir("--dataset", Path(args.dataset), INDEX, DATASET)
        outside("OUT", args.out, "--dataset", Path(args.dataset))
    metadata = export_speculators(args.dataset, args.out, args.layers, args.loss_mask, kind.name)
    dropped = f", {metadata.dropped_unsupervised} without a supervised token dropped" \
        if metadata.dropped_unsupervised else ""
    print(f"exported {metadata.rows} samples to {args.out} (speculators layout, layers "
          f"{','.join(map(str, metadata.layer_ids))}{dropped})")
    command = train_command(args.out, metadata, args.verifier)
    print(f"train with: {command}")
    cpu_flags = train_command(args.out, metadata, args.verifier, CPU_SEQ_LEN).removeprefix("speculators train ")
    print(f"  on a CPU, with speculators' Python: python -m hsx.trainer.speculators_cpu {cpu_flags}")
    if VERIFIER_PLACEHOLDER in command.split():
        print(f"  ({VERIFIER_PLACEHOLDER}: the directory or hub id of {metadata.model}, the model the dataset was "
              f"extracted with; --verifier fills it in)")
    return 0
