"""What ``hsx serve``'s sink costs the engine when they share a machine, paired
within one server.

``bench.serve`` compares servers with each other (``kafka`` ÷ ``plain``), and a
burst of one server against a burst of another moves by ±10-20 % on a shared
2-core machine. Here one ``kafka`` arm (``bench.serve``'s: files, the
connector's Kafka side by reference, ``hsx sink`` writing a raw dataset) takes
every burst, at c = 8, in pairs: one burst with its sink running, one with its
sink stopped (SIGSTOP; the connector goes on sending to the broker, nothing
consumes), in alternating order; after a stopped burst the sink resumes and
catches up before the next. ``running ÷ stopped`` of a pair is the sink's cost
on the engine's cores, with the server, its prompts and the broker's work the
same on both sides; the median over ``--rounds`` pairs with a bootstrap 95 %
interval. Also the wake-ups a second (context switches of every thread,
``/proc/<pid>/task/*/status``) of the sink, the broker and the server's process
tree in a running burst, and the sink's and the broker's CPU-seconds per burst.

    python -m bench.serve_sink [--quick] [--rounds N] [--burst-scale K] [--out FILE]
"""

from __future__ import annotations

import os
import signal
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import psutil

from bench.section import emit, parser
from bench.serve import BURST, MODEL, Arm, burst, settle, start_arm, summarize, warm_up
from hsx import models
from hsx.local.broker import EmbeddedBroker

CONCURRENCY = 8


def wakeups(pid: int) -> int:
    """Context switches so far of every thread of ``pid`` and its descendants."""
    total = 0
    root = psutil.Process(pid)
    for process in [root, *root.children(recursive=True)]:
        for task in Path(f"/proc/{process.pid}/task").glob("*"):
            try:
                lines = (task / "status").read_text().splitlines()
            except (FileNotFoundError, ProcessLookupError):
                continue  # the thread ended meanwhile
            total += sum(int(line.split()[1]) for line in lines if "ctxt_switches" in line)
    return total


def paired_burst(arm: Arm, model: Path, prompts: int, seed: int, sink_running: bool) -> dict[str, float]:
    """One burst with the sink running or stopped: requests/s, and for a running one its wake-ups a second."""
    assert arm.sink is not None and arm.broker is not None
    settle([arm])
    pids = {"sink": arm.sink.pid, "broker": arm.broker.pid, "server": arm.server.pid}
    before = {name: wakeups(pid) for name, pid in pids.items()}
    started = time.monotonic()
    if not sink_running:
        os.killpg(arm.sink.pid, signal.SIGSTOP)
    try:
        figures = burst(arm, model, CONCURRENCY, prompts, seed)
    finally:
        if not sink_running:
            os.killpg(arm.sink.pid, signal.SIGCONT)
    result = {"requests_per_s": figures[f"serve_kafka_c{CONCURRENCY}_requests_per_s"]}
    if sink_running:
        seconds = time.monotonic() - started
        result |= {f"{name}_wakeups_per_s": (wakeups(pid) - before[name]) / seconds for name, pid in pids.items()}
        result |= {f"{name}_cpu_s": figures[f"serve_kafka_c{CONCURRENCY}_{name}_cpu_s"] for name in ("sink", "broker")}
    return result


def main(quick: bool, rounds: int, burst_scale: int) -> dict[str, Any]:
    model = models.prepare(names=[MODEL])[MODEL]
    prompts = int(BURST[CONCURRENCY] * (0.25 if quick else burst_scale))
    pairs = 1 if quick else rounds
    key = f"serve_sink_c{CONCURRENCY}"
    per_pair: list[dict[str, float]] = []
    with ExitStack() as stack:
        broker = stack.enter_context(EmbeddedBroker())
        work = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-serve-sink-")))
        arm = start_arm("kafka", model, work / "kafka", broker, stack)
        warm_up(arm.url, model)
        for p in range(pairs):
            order = [True, False] if p % 2 == 0 else [False, True]
            got = {on: paired_burst(arm, model, prompts, seed=100 * p + CONCURRENCY, sink_running=on)
                   for on in order}
            running = got[True]
            ratio = round(running.pop("requests_per_s") / got[False]["requests_per_s"], 3)
            per_pair.append({f"{key}_running_vs_stopped": ratio, **{f"{key}_{n}": v for n, v in running.items()}})
            print(f"[bench.serve_sink] pair {p}: running ÷ stopped {ratio}", flush=True)
    return {f"{key}_prompts": prompts, f"{key}_pairs": pairs,
            **summarize(per_pair, ratio_suffixes=("_running_vs_stopped",))}


if __name__ == "__main__":
    cli_parser = parser(__doc__)
    cli_parser.set_defaults(rounds=6)
    cli_parser.add_argument("--burst-scale", type=int, default=3,
                            help="prompts a burst, as a multiple of bench.serve's at c = 8 (32)")
    cli = cli_parser.parse_args()
    emit(main(cli.quick, cli.rounds, cli.burst_scale), cli.out)
