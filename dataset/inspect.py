"""``hsx inspect PATH``: what a dataset (or one shard of it) holds."""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from pathlib import Path

from hsx.dataset.reader import open_dataset
from hsx.dataset.shards import INDEX, SHARDS
from hsx.dataset.storage import is_object_store
from hsx.runtime.checks import existing_dir
from hsx.runtime.errors import UsageError
from hsx.schemas import HiddenStatesReady

DATASET = "a dataset written by hsx sink"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("path", help="dataset directory or s3://bucket/prefix, or a shard file inside one")
    parser.add_argument("--sample", help="request id to describe (default: the first)")


def _root(path: str) -> tuple[str, str | None]:
    """The dataset PATH names, and the shard (relative to it) when it names one."""
    if is_object_store(path):
        root, _, name = path.rpartition(f"/{SHARDS}/")
        return (root, f"{SHARDS}/{name}") if name.endswith(".safetensors") else (path, None)
    local = Path(path)
    if not local.exists():
        raise UsageError(f"no dataset at {path} (PATH: {DATASET}, or a shard file in one)")
    if local.is_file():
        if local.parent.name != SHARDS:
            raise UsageError(f"PATH {path}: a file, but not a shard (shards lie in a dataset's {SHARDS}/)")
        return str(existing_dir("PATH", local.parent.parent, INDEX, DATASET)), f"{SHARDS}/{local.name}"
    return str(existing_dir("PATH", local, INDEX, DATASET)), None


def run(args: argparse.Namespace) -> int:
    path: str = args.path
    root, only_shard = _root(path)
    dataset = open_dataset(root)
    ids = [r for r in dataset.request_ids() if only_shard is None or dataset.event(r).shard == only_shard]
    if args.sample is not None and args.sample not in ids:
        raise UsageError(f"--sample {args.sample}: no such sample in {path}")
    if not ids:
        print(f"hsx inspect: no samples in {path}", file=sys.stderr)
        return 1
    events = [dataset.event(r) for r in ids]
    shards = sorted({e.shard for e in events})
    nbytes = sum(dataset.storage.size(s) for s in shards)
    layer_sets = sorted({tuple(e.layer_ids) for e in events})
    print(f"dataset      {root}")
    print(f"shards       {len(shards)} ({nbytes:,} bytes)")
    print(f"samples      {len(ids)}")
    print(f"tokens       {sum(e.num_tokens for e in events):,}")
    print(f"models       {', '.join(sorted({e.model for e in events}))}")
    print(f"layer ids    {'; '.join(','.join(map(str, s)) for s in layer_sets)}")
    print(f"dtype        {', '.join(sorted({e.dtype.value for e in events}))}, hidden size "
          f"{', '.join(str(h) for h in sorted({e.hidden_size for e in events}))}")
    print(f"codec        {', '.join(sorted({e.codec.value for e in events}))} (hidden states as stored; "
          "read decoded)")
    turns = [t for e in events if e.generation for t in e.generation.turns]
    if turns:
        reasons = Counter(t.finish_reason for t in turns)
        print(f"generated    {sum(1 for e in events if e.generation)} samples, {len(turns)} answers "
              f"({', '.join(f'{k} {v}' for k, v in sorted(reasons.items()))})")
    request_id = args.sample or ids[0]
    sample = dataset[request_id]
    hidden = sample["hidden_states"].float()
    print(f"\nsample       {request_id} in {dataset.event(request_id).shard}")
    print(f"tokens       {hidden.shape[0]}; loss mask "
          + (f"{int(sample['loss_mask'].sum())} tokens" if sample["loss_mask"] is not None else "none"))
    print(f"metadata     {sample['metadata']}")
    _describe_generation(dataset.event(request_id))
    print("layer        mean        std         min         max")
    for j, layer in enumerate(dataset.event(request_id).layer_ids):
        rows = hidden[:, j]
        print(f"{layer:<8} {rows.mean():>11.4f} {rows.std(correction=0):>11.4f} {rows.min():>11.4f} {rows.max():>11.4f}")
    return 0


def _describe_generation(event: HiddenStatesReady) -> None:
    """Each generated answer's token range and finish reason, and how it was sampled."""
    if event.capture == "last":
        print("capture      last (the final input token's hidden states only)")
    if event.generation is None:
        return
    params = event.generation.params.model_dump(exclude_none=True)
    print(f"generation   {params}")
    for k, turn in enumerate(event.generation.turns):
        print(f"  answer {k}   tokens [{turn.token_start}, {turn.token_end}), {turn.finish_reason}")
    print(f"  final token {event.generation.final_token_id} (no hidden state: never an input)")
