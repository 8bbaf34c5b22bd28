"""``hsx``: one command line for every part of the pipeline."""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from pathlib import Path

from runtime.logs import configure_logging

def _broker(args: argparse.Namespace) -> int:
    from runtime.broker import EmbeddedBroker

    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    with EmbeddedBroker(port=args.port, host=args.host) as broker:
        print(broker.bootstrap, flush=True)
        while not stop.wait(0.5):
            if not broker.running:
                print("hsx broker: the broker process exited", file=sys.stderr)
                return 1
    return 0


def _models_prepare(args: argparse.Namespace) -> int:
    from hsx import models

    for name, path in models.prepare(args.dir).items():
        print(f"{name}: {path}")
    return 0


def _produce(args: argparse.Namespace) -> int:
    from producer import cli

    return cli.run(args)


def _extract(args: argparse.Namespace) -> int:
    from extractor import cli

    return cli.run(args)


def _sink(args: argparse.Namespace) -> int:
    from sink import cli

    return cli.run(args)


def _inspect(args: argparse.Namespace) -> int:
    from sink import inspect

    return inspect.run(args)


def _export(args: argparse.Namespace) -> int:
    from sink import export

    return export.run(args)


def _demo(args: argparse.Namespace) -> int:
    from hsx import demo

    return demo.run(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hsx", description="Streaming hidden-states extraction with vLLM and Kafka.")
    parser.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING, ERROR (default INFO)")
    parser.add_argument("--log-format", choices=["text", "json"], default="text", help="log line format")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    broker = commands.add_parser("broker", help="run the embedded Kafka-protocol broker (in-memory, for development)")
    broker.add_argument("--port", type=int, help="port to listen on (default: a free one)")
    broker.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    broker.set_defaults(handler=_broker)

    from producer import cli as producer_cli

    produce = commands.add_parser("produce", help="publish prompts from a JSONL file")
    producer_cli.add_arguments(produce)
    produce.set_defaults(handler=_produce)

    models = commands.add_parser("models", help="prepare the bundled models")
    models_commands = models.add_subparsers(dest="models_command", required=True, metavar="ACTION")
    prepare = models_commands.add_parser("prepare", help="build the tiny test model and SmolLM2 (cached)")
    prepare.add_argument("--dir", type=Path, help="cache directory (env HSX_CACHE_DIR, default ~/.cache/hsx)")
    prepare.set_defaults(handler=_models_prepare)

    from extractor import cli as extractor_cli

    extract = commands.add_parser("extract", help="consume prompts and extract hidden states with vLLM")
    extractor_cli.add_arguments(extract)
    extract.set_defaults(handler=_extract)

    from sink import cli as sink_cli

    sink = commands.add_parser("sink", help="write hidden-state blocks to a sharded safetensors dataset")
    sink_cli.add_arguments(sink)
    sink.set_defaults(handler=_sink)

    from sink import inspect as inspect_module

    inspect = commands.add_parser("inspect", help="summarize a dataset or one of its shards")
    inspect_module.add_arguments(inspect)
    inspect.set_defaults(handler=_inspect)

    from sink import export as export_module

    export = commands.add_parser("export", help="write a dataset in another trainer's layout (speculators)")
    export_module.add_arguments(export)
    export.set_defaults(handler=_export)

    from hsx import demo as demo_module

    demo = commands.add_parser("demo", help="run the whole pipeline on a small bundled prompt mix")
    demo_module.add_arguments(demo)
    demo.set_defaults(handler=_demo)

    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    configure_logging(args.log_level, args.log_format)
    return int(args.handler(args))


if __name__ == "__main__":
    sys.exit(main())
