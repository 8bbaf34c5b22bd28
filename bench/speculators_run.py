"""``speculators train`` with its metric records kept: every dict speculators
logs on ``speculators.metrics`` (each logged step's loss and rate, each epoch's
validation) written as one JSON line, with the time it was logged, to a file
the benchmarks read, instead of its console.

speculators writes an epoch's ``val_metrics.json`` only where that epoch's
validation loss is its best so far, so the metrics file is the one place every
epoch's validation is found (:func:`validation`).

    python -m bench.speculators_run --metrics FILE -- SPECULATORS_TRAIN_FLAGS ...

With an accelerator this is speculators' own entry; without one, the CPU
adaptations of :mod:`hsx.trainer.speculators_cpu`. Afterwards, on a GPU, the
peak memory is added as a last record.
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from pathlib import Path
from typing import Any

import torch


class MetricsFile(logging.Handler):
    """speculators' metric records (dicts on ``speculators.metrics``), one JSON
    line each with the time it was logged."""

    def __init__(self, path: Path) -> None:
        super().__init__()
        self.path = path

    def emit(self, record: logging.LogRecord) -> None:
        if isinstance(record.msg, dict) and not getattr(record, "hparams", False):
            with self.path.open("a") as f:
                f.write(json.dumps({"t": record.created, **record.msg}, default=str) + "\n")


def run_speculators(argv: list[str], metrics: Path) -> None:
    """``speculators train`` with ``argv`` in this process, its metrics also
    written to ``metrics``."""
    from speculators.train import cli

    configure = cli.setup_metric_logger

    def configure_and_record(*args: Any, **kwargs: Any) -> None:
        configure(*args, **kwargs)  # dictConfig: replaces the handlers a logger had before
        logging.getLogger("speculators.metrics").addHandler(MetricsFile(metrics))

    cli.setup_metric_logger = configure_and_record
    if torch.accelerator.is_available():
        from speculators.train.config import TrainConfig

        cli.main(TrainConfig.resolve(argv))
    else:
        from hsx.trainer.speculators_cpu import main

        main(argv)
    if torch.cuda.is_available():
        with metrics.open("a") as f:
            f.write(json.dumps({"t": time.time(), "peak_allocated": torch.cuda.max_memory_allocated(),
                                "peak_reserved": torch.cuda.max_memory_reserved()}) + "\n")


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """The records of a metrics file; none where it is not written yet."""
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def validation(records: list[dict[str, Any]], epoch: int) -> dict[str, float] | None:
    """The validation metrics of ``epoch`` (0-based, as speculators numbers its
    checkpoints), from its last run that validated it; None before it is done."""
    return next((r["val"] for r in reversed(records) if "val" in r and r.get("epoch") == epoch), None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--metrics", type=Path, required=True, help="the JSON-lines file the records are added to")
    parser.add_argument("argv", nargs=argparse.REMAINDER, help="speculators train's flags (after --)")
    args = parser.parse_args()
    run_speculators(args.argv[1:] if args.argv[:1] == ["--"] else args.argv, args.metrics)


if __name__ == "__main__":
    main()
