"""``python -m bench.loader [--quick]``: how fast trainer/'s map-style loader
hands a trainer its batches, against reading the same bytes with safetensors
alone.

The dataset is demo-sized and shaped like the demo's (SmolLM2-135M: hidden
576, layers 2, 15, 27, 30, float32; 64 samples of 20-400 tokens, 2 partitions),
written through the sink's write path to local disk. Each side reads every
sample once per epoch; the first epoch warms the page cache and is not timed,
so both sides read from memory and the figure is the loader's own cost:

* ``raw``: ``safe_open`` each shard, ``get_tensor`` every tensor of every sample, copied
  into memory of its own (``clone``), as a batch holds it (``get_tensor`` alone
  only maps the bytes);
* ``file_read``: the shard files read whole into bytes, for scale (no tensors);
* ``w0``/``w1``/``w2``: ``HsxDataset`` under a ``DataLoader`` with 0, 1, 2
  workers (persistent, so worker start-up is not counted), batches packed to
  2,048 tokens by ``PackedCollate`` (float32: no cast) without cutting a sample.

Epochs of the sides are interleaved, the median epoch counts. Figures merge into
``bench/results.json`` as flat ``loader_*`` keys, and ``docs/benchmarks.md`` is
rendered again.
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import safe_open
from torch.utils.data import DataLoader

from bench.sink_scale import standalone
from hsx.dataset.shards import SHARDS
from hsx.local.training_data import TrainingDataSpec, write_training_dataset
from hsx.trainer import HsxDataset, PackedCollate

TOTAL = 2048
DEMO = TrainingDataSpec(samples=64, min_tokens=20, max_tokens=400, layer_ids=(2, 15, 27, 30), hidden_size=576,
                        vocab=49152, per_shard=32)
QUICK = TrainingDataSpec(samples=16, min_tokens=20, max_tokens=400, layer_ids=(2, 15, 27, 30), hidden_size=576,
                         vocab=49152, per_shard=8)


def _packs(lengths: list[int]) -> list[list[int]]:
    """Consecutive rows, as many as fit in TOTAL tokens (one alone if longer)."""
    packs: list[list[int]] = [[]]
    used = 0
    for row, n in enumerate(lengths):
        if packs[-1] and used + n > TOTAL:
            packs.append([])
            used = 0
        packs[-1].append(row)
        used += n
    return packs


def _raw(root: Path) -> Callable[[], int]:
    def epoch() -> int:
        count = 0
        for shard in sorted((root / SHARDS).glob("*.safetensors")):
            with safe_open(str(shard), framework="pt") as handle:
                for name in handle.keys():
                    # A copy in memory of its own, as a batch is: get_tensor alone may
                    # only map the bytes, and a trainer cannot hold on to a map.
                    handle.get_tensor(name).clone()
                    count += name.endswith("/hidden_states")
        return count
    return epoch


def _file_read(root: Path) -> Callable[[], int]:
    def epoch() -> int:
        for shard in sorted((root / SHARDS).glob("*.safetensors")):
            shard.read_bytes()
        return -1
    return epoch


def _loader(dataset: HsxDataset, workers: int) -> Callable[[], int]:
    loader = DataLoader(dataset, batch_sampler=_packs(dataset.lengths), num_workers=workers,
                        collate_fn=PackedCollate(TOTAL, torch.float32), persistent_workers=workers > 0)

    def epoch() -> int:
        return sum(len(batch["request_ids"]) for batch in loader)
    return epoch


def run(quick: bool) -> dict[str, object]:
    spec, rounds = (QUICK, 2) if quick else (DEMO, 15)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "ds"
        events = write_training_dataset(root, spec, partitions=2)
        nbytes = sum(e.num_tokens * len(e.layer_ids) * e.hidden_size * 4 for e in events)
        dataset = HsxDataset(root, drop_unsupervised=False)
        sides = {"raw": _raw(root), "file_read": _file_read(root),
                 **{f"w{w}": _loader(dataset, w) for w in (0, 1, 2)}}
        times: dict[str, list[float]] = {side: [] for side in sides}
        for side, epoch in sides.items():  # warm-up: page cache, workers started
            assert epoch() in (len(events), -1), side
        for _ in range(rounds):
            for side, epoch in sides.items():
                t0 = time.perf_counter()
                epoch()
                times[side].append(time.perf_counter() - t0)
    results: dict[str, object] = {
        "loader_quick": quick, "loader_samples": len(events), "loader_tokens": sum(e.num_tokens for e in events),
        "loader_hidden_bytes": nbytes, "loader_rounds": rounds,
        "loader_shape": f"{len(spec.layer_ids)} layers x {spec.hidden_size} float32",
    }
    raw = statistics.median(times["raw"])
    for side, values in times.items():
        seconds = statistics.median(values)
        results[f"loader_{side}_samples_per_s"] = round(len(events) / seconds, 1)
        results[f"loader_{side}_gb_s"] = round(nbytes / seconds / 1e9, 3)
        if side not in ("raw", "file_read"):
            results[f"loader_{side}_vs_raw_ratio"] = round(raw / seconds, 3)
    return results


def main() -> None:
    out = standalone(__doc__, "16 samples, 2 rounds: a smoke check", run)
    figures = {k: v for k, v in json.loads(out.read_text()).items() if k.startswith("loader_")}
    print("\n".join(f"{key:32} {value}" for key, value in figures.items()), file=sys.stderr)

if __name__ == "__main__":
    main()
