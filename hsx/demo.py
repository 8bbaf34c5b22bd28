"""``hsx demo``: ``hsx run`` on 68 bundled prompts (text, token ids, chats, and
chats whose answers the verifier regenerates) with
SmolLM2-135M-Instruct on CPU, then one sample checked against HF transformers.

The broker is ``HSX_KAFKA_BOOTSTRAP``, else a Kafka container when Docker
answers, else the embedded one; the dataset lands in ``out/demo`` (emptied first,
so the demo never resumes an earlier one). With ``--s3`` it lands in an S3
bucket instead: a SeaweedFS server on loopback (``HSX_TEST_S3_ENDPOINT``, else
one started for the demo, its data and the logs in ``out/demo-s3``), the
services pointed at it by the ``AWS_*`` environment, as a user's would be.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
from collections.abc import Iterator
from importlib import resources
from pathlib import Path

from hsx import models
from hsx.dataset.reader import open_dataset
from hsx.dataset.shards import DATASET_FOLDERS
from hsx.local.broker import dev_bootstrap
from hsx.local.s3server import LocalS3, dev_s3
from hsx.producer.sources import read_jsonl
from hsx.reference import HFReference, max_relative_error
from hsx.running.command import run_pipeline, stopping_children_on_interrupt
from hsx.running.plan import STAGING, RunPlan
from hsx.runtime.checks import writable_dir
from hsx.runtime.errors import ExitCode, UsageError
from hsx.summary import RunReport, render

DEMO_PROMPTS = "demo_prompts.jsonl"
MODEL = "smollm2-135m-instruct"
DEFAULT_OUTPUT = Path("out/demo")
S3_DATASET = "s3://hsx-demo/demo"
ENGINE_ARGV = ["--dtype", "float32", "--enforce-eager", "--max-model-len", "2048"]
"""float32 for an exact comparison with HF transformers; no compilation, which
would cost more than the demo's extraction on CPU."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--output", type=Path, default=DEFAULT_OUTPUT, help="dataset directory (emptied first)")
    parser.add_argument("--s3", action="store_true",
                        help=f"write the dataset to S3 ({S3_DATASET} on a local SeaweedFS server; its data and "
                             "the logs in --output, default out/demo-s3)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def run(args: argparse.Namespace) -> int:
    if args.s3 and args.output == DEFAULT_OUTPUT:
        args.output = Path("out/demo-s3")
    _check_output(args.output)
    model_dir = models.prepare(names=[MODEL])[MODEL]
    shutil.rmtree(args.output, ignore_errors=True)
    with (stopping_children_on_interrupt(), (resources.files("hsx") / "data" / DEMO_PROMPTS).open("rb") as stream,
          dev_bootstrap() as bootstrap, _dataset(args) as (output, logs)):
        plan = RunPlan(model=model_dir, output=output, lines=read_jsonl(stream, DEMO_PROMPTS), log_dir=logs,
                       engine_argv=ENGINE_ARGV, bootstrap=bootstrap, progress=not args.no_progress)
        report = run_pipeline(plan)
        code = _check(report, model_dir)
    return code


@contextlib.contextmanager
def _dataset(args: argparse.Namespace) -> Iterator[tuple[str, Path | None]]:
    """Where the demo writes: ``--output``, or with ``--s3`` a bucket on a
    SeaweedFS server kept in ``--output`` (the services find it by ``AWS_*``)."""
    if not args.s3:
        yield str(args.output), None
        return
    with dev_s3(args.output / "seaweedfs") as server:
        local = isinstance(server, LocalS3)
        server.create_bucket(S3_DATASET.removeprefix("s3://").split("/")[0])
        saved = dict(os.environ)
        os.environ.clear()
        os.environ.update(server.child_environ(saved))
        try:
            if not local:
                _empty(S3_DATASET)  # a fresh local server starts empty; an external one may hold an earlier demo
            yield S3_DATASET, args.output / "logs"
        finally:
            os.environ.clear()
            os.environ.update(saved)
    if local:  # reached only when the demo finished: an error passes through the yield above
        print(f"[demo] the demo's S3 server has stopped; its data stays in {args.output / 'seaweedfs'}")


def _empty(url: str) -> None:
    """Delete every object under ``url`` (the demo's own prefix), as the local
    demo empties ``out/demo``."""
    import obstore

    from hsx.dataset.storage.s3 import S3Storage

    store = S3Storage(url).store
    for batch in obstore.list(store):
        obstore.delete(store, [meta["path"] for meta in batch])


def _check_output(output: Path) -> None:
    """The demo empties its output first: only a new or empty directory, or an
    earlier hsx dataset (``logs`` and the sink's folders, nothing else) may be
    emptied, never a directory that holds anything of the user's."""
    writable_dir("--output", output)
    if output.is_dir():
        foreign = sorted(p.name for p in output.iterdir() if p.name not in (*DATASET_FOLDERS, "logs", STAGING, "seaweedfs"))
        if foreign:
            raise UsageError(f"--output {output}: holds {', '.join(foreign[:3])}, which is not an hsx dataset; "
                             "the demo empties its output, so choose another directory")


def _check(report: RunReport, model_dir: Path) -> int:
    """The run's summary plus one sample against HF transformers on the same weights."""
    dataset = open_dataset(report.output)
    ids = sorted(dataset.request_ids())
    # A given sample and one whose answers the verifier generated.
    probes = [ids[0], *(r for r in ids if dataset.event(r).generation is not None)][:2]
    reference = HFReference(model_dir)
    error = 0.0
    for probe in probes:
        sample = dataset[probe]
        expected = reference.hidden_states(sample["token_ids"].tolist(), dataset.event(probe).layer_ids)
        error = max(error, max_relative_error(sample["hidden_states"], expected))
    rows = report.rows() + [
        ("shards written", f"{report.sunk.get('shards', 0)}"),
        ("duplicates dropped / rejected", f"{report.sunk.get('duplicates', 0)} / {report.sunk.get('rejected', 0)}"),
        (f"max rel. error vs HF transformers ({', '.join(probes)})", f"{error:.1e}"),
    ]
    print(render(rows))
    ok = report.ok and len(dataset) == report.published.sent and error <= 1e-4
    print(f"[demo] {'OK' if ok else 'FAILED'}: dataset in {report.output}, "
          f"read it with hsx.open_dataset('{report.output}')")
    return ExitCode.OK if ok else ExitCode.FAILED
