"""Which feeds a trainer faster from a served model: speculators' synchronous
online loop against ``hsx serve``, or ``hsx train-draft``'s reader of the ready
events of served traffic.

One ``hsx serve`` (files and a dataset: its sink on an embedded broker), the
bench's model and layers, rows of ``INPUT_LEN`` random token ids (seed 0), each
asked for with ``max_tokens=1`` as speculators' client asks:

* ``hsx``: the rows sent as traffic at concurrency ``CONCURRENCY`` while a
  :class:`~hsx.trainer.online.ReadyStream` (``hsx train-draft``'s reader, in
  the trainer's process) reads ``hidden_states.ready``; samples/s = rows ÷ the
  time from the first request to the last sample in the trainer's hands;
* ``speculators_w<N>``: the same rows through speculators' ``ArrowDataset`` with
  ``on_missing="generate"`` under a ``DataLoader`` with N workers (speculators'
  trainer defaults to 12); each worker asks for one row at a time and waits on
  its file (:mod:`bench.speculators_feed`, run with ``.venv-speculators``).

A few warm-up requests first, read off the stream, so neither side pays the
server's first steps. Every run sends rows of its own (vLLM's prefix cache would
serve a repeated row without its prefill). ``--rounds`` rounds (3; one with
``--quick``), the sides' order alternating; each figure is the median over rounds.

    python -m bench.online_feed [--quick] [--rounds N] [--out FILE]
"""

from __future__ import annotations

import json
import random
import statistics
import subprocess
import tempfile
import threading
import time
import urllib.request
import uuid
from argparse import Namespace
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from bench.acceptance import SPECULATORS_PY
from bench.section import emit, parser
from hsx import models
from hsx.local.broker import EmbeddedBroker, free_port
from hsx.local.spawn import HsxService, cpu_engine_env
from hsx.schemas.topics import READY
from hsx.trainer.online import ReadyStream

MODEL = "smollm2-135m-instruct"
LAYERS = [2, 15, 27, 30]
INPUT_LEN = 256
CONCURRENCY = 8
WARM_UP = 4
COUNT = 48
"""Rows per run (8 with ``--quick``)."""
WORKERS = ["0", "4"]
Rows = Callable[[int], list[list[int]]]
"""Fresh rows of random token ids, so many."""


def _serve(model: Path, work: Path, bootstrap: str) -> HsxService:
    serve = HsxService("serve", ["serve", "--model", str(model), "--dtype", "float32", "--max-model-len", "1024",
                                 "--enforce-eager", "--layers", ",".join(map(str, LAYERS)),
                                 "--port", str(port := free_port()), "--health-port", str(free_port()),
                                 "--shared-storage-path", str(work / "files"), "--output", str(work / "dataset"),
                                 "--bootstrap", bootstrap], work, health=False, ready_path="/health",
                       env=cpu_engine_env(HSX_TOPIC_READY=READY))
    serve.port = port
    return serve


def _complete(url: str, model: str, row: list[int]) -> None:
    body = json.dumps({"model": model, "prompt": row, "max_tokens": 1}).encode()
    request = urllib.request.Request(f"{url}/v1/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=300) as response:
        json.load(response)


def _read(stream: ReadyStream, count: int, delivered: list[float]) -> None:
    """Take ``count`` samples off the stream (noting when each arrived), then commit them."""
    taken = []
    for sample in stream:
        taken.append(sample)
        delivered.append(time.perf_counter())
        if len(taken) == count:
            break
    stream.commit(taken)


def _hsx(url: str, model: str, rows: list[list[int]], stream: ReadyStream) -> dict[str, float]:
    delivered: list[float] = []
    reader = threading.Thread(target=_read, args=(stream, len(rows), delivered), daemon=True)
    reader.start()
    start = time.perf_counter()
    with ThreadPoolExecutor(CONCURRENCY) as pool:
        list(pool.map(lambda row: _complete(url, model, row), rows))
    answered = time.perf_counter()
    reader.join(timeout=300)
    if len(delivered) < len(rows):
        raise RuntimeError(f"the trainer got {len(delivered)} of {len(rows)} samples")
    return {"samples": len(rows), "seconds": round(delivered[-1] - start, 3),
            "traffic_seconds": round(answered - start, 3)}


def _speculators(url: str, runs: dict[str, list[list[int]]], work: Path) -> dict[str, dict[str, float]]:
    if not SPECULATORS_PY.exists():
        raise SystemExit(f"{SPECULATORS_PY} is missing: run `make speculators`")
    work.mkdir()
    (work / "rows.json").write_text(json.dumps(runs))
    run = subprocess.run([str(SPECULATORS_PY), str(Path(__file__).with_name("speculators_feed.py")), url, str(work)],
                         capture_output=True, text=True, timeout=1800)
    if run.returncode:
        raise RuntimeError(f"speculators_feed exited {run.returncode}:\n{run.stderr[-4000:]}")
    return json.loads(run.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def _round(url: str, model: str, stream: ReadyStream, rows: Rows, count: int, hsx_first: bool,
           work: Path) -> dict[str, Any]:
    """One round: each side on rows of its own, in the order given. The
    speculators side's samples (they join the dataset too) are taken off the
    stream after it, so the hsx side's reader starts behind them."""
    figures: dict[str, Any] = {}
    for side in (["hsx", "speculators"] if hsx_first else ["speculators", "hsx"]):
        if side == "hsx":
            timed = _hsx(url, model, rows(count), stream)
            figures["feed_hsx_traffic_samples_per_s"] = round(timed["samples"] / timed["traffic_seconds"], 2)
            runs = {"hsx": timed}
        else:
            timed_runs = _speculators(url, {n: rows(count) for n in WORKERS}, work / f"speculators-{uuid.uuid4().hex}")
            runs = {f"speculators_{k}": v for k, v in timed_runs.items()}
            _read(stream, count * len(WORKERS), [])
        for name, timed in runs.items():
            figures[f"feed_{name}_samples_per_s"] = round(timed["samples"] / timed["seconds"], 2)
            figures[f"feed_{name}_seconds"] = timed["seconds"]
    return figures


def main(args: Namespace) -> dict[str, Any]:
    model = models.prepare(names=[MODEL])[MODEL]
    count = 8 if args.quick else COUNT
    rounds = 1 if args.quick else args.rounds
    rng = random.Random(0)

    def rows(n: int) -> list[list[int]]:
        return [[rng.randrange(1000, 40000) for _ in range(INPUT_LEN)] for _ in range(n)]

    results: dict[str, Any] = {"feed_model": MODEL, "feed_rows": count, "feed_input_len": INPUT_LEN,
                               "feed_concurrency": CONCURRENCY, "feed_rounds": rounds}
    per_round: list[dict[str, Any]] = []
    with EmbeddedBroker() as broker, tempfile.TemporaryDirectory(prefix="bench-feed-") as tmp:
        work = Path(tmp)
        with _serve(model, work, broker.bootstrap) as serve:
            serve.wait_ready(timeout=900)
            url = f"http://127.0.0.1:{serve.port}"
            stream = ReadyStream(broker.bootstrap, work / "dataset", group_id=f"bench-feed-{uuid.uuid4().hex[:8]}")
            _hsx(url, str(model), rows(WARM_UP), stream)
            for r in range(rounds):
                per_round.append(_round(url, str(model), stream, rows, count, r % 2 == 0, work))
            stream.close()
    for key in per_round[0]:
        values = [f[key] for f in per_round]
        results[key] = round(statistics.median(values), 3)
        if rounds > 1:
            results[f"{key}_rounds"] = values
    results["feed_hsx_vs_speculators_w0"] = round(results["feed_hsx_samples_per_s"]
                                                  / results["feed_speculators_w0_samples_per_s"], 2)
    return results


if __name__ == "__main__":
    cli = parser(__doc__).parse_args()
    emit(main(cli), cli.out)
