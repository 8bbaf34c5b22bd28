"""``hsx``: one command line for every part of the pipeline."""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import signal
import sys
import threading
from pathlib import Path
from typing import NoReturn

from hsx.runtime.checks import integer, writable_dir
from hsx.runtime.errors import ExitCode, HsxError, UsageError
from hsx.runtime.logs import configure_logging

log = logging.getLogger("hsx")
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")

# Each module has add_arguments(parser) and run(args) -> exit code.
SERVICE_COMMANDS = [
    ("produce", "publish prompts from a file (JSONL, JSON, Parquet, Arrow, datasets)", "hsx.producer.cli"),
    ("extract", "consume prompts and extract hidden states with vLLM", "hsx.extractor.cli"),
    ("sink", "write hidden-state blocks to a sharded safetensors dataset", "hsx.sink.cli"),
    ("inspect", "summarize a dataset or one of its shards", "hsx.dataset.inspect"),
    ("export", "write a dataset in another trainer's layout (speculators)", "hsx.trainer.export"),
    ("train-draft", "train a speculators draft (EAGLE-3, DFlash, P-EAGLE) online from hidden_states.ready",
     "hsx.trainer.draft"),
    ("eval-draft", "a draft's acceptance on your prompts, in vLLM's speculative decoding", "hsx.drafts.cli"),
    ("run", "the whole pipeline on one machine: your prompts in, a dataset out", "hsx.running.command"),
    ("serve", "vLLM's OpenAI server with every response's hidden states as a file, in a dataset, or both",
     "hsx.serving.command"),
    ("demo", "run the whole pipeline on a small bundled prompt mix", "hsx.demo"),
]


class _Parser(argparse.ArgumentParser):
    """argparse with its errors in one line (usage and all would be a screenful
    for ``hsx extract``); the exit code stays argparse's 2, :attr:`ExitCode.USAGE`."""

    def error(self, message: str) -> NoReturn:
        self.exit(ExitCode.USAGE, f"{self.prog}: {message} (see {self.prog} --help)\n")


def _broker(args: argparse.Namespace) -> int:
    from hsx.local.broker import EmbeddedBroker, check_listen

    check_listen(args.host, args.port)
    stop = threading.Event()
    # SIGHUP too (the terminal closed): the broker runs in a session of its own,
    # so only this process can stop it.
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
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

    if args.dir is not None:
        writable_dir("--dir", args.dir)
    try:
        prepared = models.prepare(args.dir)
    except models.ModelSourceMissingError as exc:  # a package to install: nothing was built
        raise UsageError(str(exc)) from exc
    for name, path in prepared.items():
        print(f"{name}: {path}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="hsx", description="Streaming hidden-states extraction with vLLM and Kafka.")
    parser.add_argument("--log-level", default="INFO", type=str.upper, choices=LOG_LEVELS,
                        help="DEBUG (adds tracebacks to errors), INFO, WARNING, ERROR (default INFO)")
    parser.add_argument("--log-format", choices=["text", "json"], default="text", help="log line format")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    broker = commands.add_parser("broker", help="run the embedded Kafka-protocol broker (in-memory, for development)")
    broker.add_argument("--port", type=integer(1, 65535), help="port to listen on (default: a free one)")
    broker.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    broker.set_defaults(handler=_broker)

    models = commands.add_parser("models", help="prepare the bundled models")
    models_commands = models.add_subparsers(dest="models_command", required=True, metavar="ACTION")
    prepare = models_commands.add_parser("prepare", help="build the tiny test models (Llama, Qwen3) and SmolLM2 (cached)")
    prepare.add_argument("--dir", type=Path, help="cache directory (env HSX_CACHE_DIR, default ~/.cache/hsx)")
    prepare.set_defaults(handler=_models_prepare)

    for name, help_text, module_name in SERVICE_COMMANDS:
        module = importlib.import_module(module_name)
        sub = commands.add_parser(name, help=help_text)
        module.add_arguments(sub)
        sub.set_defaults(handler=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run one command; an :class:`HsxError` becomes one log line and its exit code
    (the table is :class:`hsx.runtime.errors.ExitCode`), Ctrl-C one line and 130, a
    reader of stdout that went away (``hsx inspect ... | head``) a quiet 141."""
    args = build_parser().parse_args(argv)
    configure_logging(args.log_level, args.log_format)
    try:
        code = _run(args)
        sys.stdout.flush()  # here, not in Python's own flush at exit, where a closed pipe prints a traceback
        return code
    except BrokenPipeError:
        # stdout points at /dev/null, so the flush at exit finds nothing left to fail on.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return int(ExitCode.BROKEN_PIPE)


def _run(args: argparse.Namespace) -> int:
    try:
        return int(args.handler(args))
    except HsxError as exc:
        log.debug("%s", exc, exc_info=True)
        log.error("hsx %s: %s", args.command, exc)
        return int(exc.exit_code)
    except KeyboardInterrupt:  # each command stops its children on the way out (context managers, finally)
        log.debug("interrupted", exc_info=True)
        log.error("hsx %s: interrupted (Ctrl-C)", args.command)
        return int(ExitCode.INTERRUPTED)


if __name__ == "__main__":
    sys.exit(main())
