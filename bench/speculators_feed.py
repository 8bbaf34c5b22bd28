"""Run with .venv-speculators' python (from :mod:`bench.online_feed`): how many
samples a second speculators' online data path hands its trainer from a vLLM
server, generating every row (``ArrowDataset(on_missing="generate")``, what
``speculators train --on-missing generate --vllm-endpoint URL`` builds).

    speculators_feed.py URL WORK_DIR

WORK_DIR/rows.json maps a number of DataLoader workers to its rows (token id lists; each
its own, so that no run finds another's prefixes in vLLM's cache), saved in
speculators' Arrow layout. Each is read once through a ``DataLoader`` as
speculators' trainer builds it (spawned workers; 0: in the trainer's process,
one request at a time); the clock starts when iteration starts, so spawning the
workers counts (a trainer pays it once per run). Prints one JSON object:
``{"w<N>": {"samples": ..., "seconds": ...}}``.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch
from datasets import Dataset
from speculators.train.data import ArrowDataset
from torch.utils.data import DataLoader


def _timed(dataset: ArrowDataset, workers: int) -> dict[str, float]:
    loader = DataLoader(dataset, batch_size=None, num_workers=workers,
                        multiprocessing_context="spawn" if workers else None)
    start = time.perf_counter()
    samples = 0
    for item in loader:
        if not isinstance(item, dict):
            raise SystemExit(f"a row was not generated: {item}")
        samples += 1
    return {"samples": samples, "seconds": round(time.perf_counter() - start, 3)}


def main() -> None:
    url, work = sys.argv[1], Path(sys.argv[2])
    runs = json.loads((work / "rows.json").read_text())
    timed = {}
    for workers, rows in runs.items():
        data = work / f"data-w{workers}"
        arrow = Dataset.from_dict({"input_ids": rows, "loss_mask": [[1] * len(r) for r in rows],
                                   "seq_len": [len(r) for r in rows]})
        arrow.set_format(type="torch")
        arrow.save_to_disk(str(data))
        dataset = ArrowDataset(max_len=4096, datapath=data, vllm_endpoint=f"{url}/v1", on_missing="generate",
                               hidden_states_dtype=torch.float32)
        timed[f"w{workers}"] = _timed(dataset, int(workers))
    print(json.dumps(timed))

if __name__ == "__main__":
    main()
