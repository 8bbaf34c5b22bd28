"""A coverage-guided fuzzing campaign: ``python -m tests.fuzz [--seconds N] [--runs N]
[--only NAME ...] [--jobs N]`` (``make fuzz``, ``FUZZ_ARGS`` passes the options).

Each target runs in a process of its own under atheris (libFuzzer for Python):
hsx's modules are imported with coverage instrumentation, and libFuzzer stops at
the first finding (``check`` raising :class:`~tests.fuzz.target.Finding`, an
input slower than ``MAX_SECONDS``, or the process over its RSS limit), or after
``--seconds`` (default 600) or ``--runs`` executions (default one million),
whichever comes first. Everything lands in ``out/fuzz/<target>/``: the working
corpus (``corpus/``, seeded from ``tests/fuzz/corpus/<target>`` and the
target's regressions), libFuzzer's log (``fuzz.log``) and the findings
(``crash-*``, ``timeout-*``, ``oom-*``). A timeout is a finding only if its input
is slow again when replayed in a fresh process: on a busy machine a process can
stall for seconds, so one that is not is set aside (``unconfirmed/``) and the
target fuzzes on for the time left. One table row per target is printed and
``out/fuzz.json`` written; the exit status is 1 when any target had a finding
or did not run.

A finding's file is the input: replay it with ``check``, fix the parser, and
keep the file as ``tests/fuzz/regressions/<target>/<name-of-the-defect>``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import re
import shutil
import subprocess
import sys
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

from tests.fuzz.target import CORPUS, MAX_SECONDS, REGRESSIONS

OUT = Path("out")
FUZZ_OUT = OUT / "fuzz"
REPORT = OUT / "fuzz.json"
DEFAULT_SECONDS = 600
DEFAULT_RUNS = 1_000_000
RSS_LIMIT_MB = 2048
INSTRUMENTED = ["hsx"]
"""The packages whose code libFuzzer sees (pydantic, numpy and the tokenizer are
native or not ours: instrumenting them would slow every execution for nothing)."""
STARTUP_GRACE_S = 300
"""Beyond ``--seconds``: loading the tokenizer and running the seed corpus once."""
ARTIFACTS = ("crash-", "timeout-", "oom-", "leak-")
CONFIRM_TRIES = 3
MIN_SEGMENT_S = 10
"""Less fuzzing time left than this after an unconfirmed timeout ends the target's run."""

_STATUS = re.compile(r"^#(\d+)\s+\S+\s+cov: (\d+) ft: (\d+) corp: (\d+)/", re.MULTILINE)
_EXECUTED = re.compile(r"^stat::number_of_executed_units: (\d+)", re.MULTILINE)


@dataclass
class Result:
    """What one target's run came to."""

    target: str
    executions: int = 0
    seconds: float = 0.0
    """Wall time, the tokenizer's loading and the seed corpus' first pass included."""
    coverage: int | None = None
    """libFuzzer's ``cov:``: instrumented edges covered, of the last status line."""
    features: int | None = None
    """libFuzzer's ``ft:``: coverage features (edges with hit counts, comparisons)."""
    corpus: int | None = None
    findings: list[str] = field(default_factory=list)
    """Paths of the inputs libFuzzer saved: ``crash-*``, ``timeout-*``, ``oom-*``."""
    unconfirmed: list[str] = field(default_factory=list)
    """Timeouts whose input then ran within ``MAX_SECONDS`` in a fresh process
    (the machine was busy, the parser was not slow): set aside, not findings."""
    error: str | None = None
    """Why the target did not run to its end without producing a finding, if it did not."""
    log: str = ""

    @property
    def failed(self) -> bool:
        return bool(self.findings) or self.error is not None


def libfuzzer_args(name: str, seconds: int, runs: int) -> list[str]:
    """libFuzzer's flags and corpus folders for target ``name``: new inputs go to
    the first folder; the seeds and regressions are read, never written."""
    folder = FUZZ_OUT / name
    corpora = [folder / "corpus"] + [d for d in (CORPUS / name, REGRESSIONS / name) if d.is_dir()]
    return [f"-max_total_time={seconds}", f"-runs={runs}", f"-timeout={math.ceil(MAX_SECONDS)}",
            f"-rss_limit_mb={RSS_LIMIT_MB}", "-print_final_stats=1", f"-artifact_prefix={folder}/",
            *map(str, corpora)]


def fuzz_in_this_process(name: str, seconds: int, runs: int) -> None:
    """The worker: import the targets with hsx instrumented, then hand target
    ``name`` to libFuzzer, which exits the process when it is done."""
    import atheris

    with atheris.instrument_imports(include=INSTRUMENTED):
        from tests.fuzz.target import Finding, check, inputs, targets

        fuzz_target = targets()[name]
        # Targets import what they parse with lazily (replaying a corpus stays
        # cheap): run the seeds once here so those modules are instrumented too.
        # Imported afterwards they gave libFuzzer no coverage (export_metadata: 0).
        for seed in inputs(name):
            with contextlib.suppress(Finding):
                check(fuzz_target, seed.read_bytes())

    def test_one_input(data: bytes) -> None:
        try:
            check(fuzz_target, data)
        except Finding:
            # libFuzzer's SIGABRT handler saves the input and exits at once. Left to
            # atheris, the exception would exit through Python's finalization, which
            # restores SIGALRM's default action while libFuzzer's 1 s timer still runs:
            # with torch loaded it outlives a tick, and the alarm kills the process
            # before the input is saved.
            traceback.print_exc()
            sys.stderr.flush()
            os.abort()

    atheris.Setup([sys.argv[0], *libfuzzer_args(name, seconds, runs)], test_one_input)
    atheris.Fuzz()


def run_target(name: str, seconds: int, runs: int) -> Result:
    """Fuzz ``name`` in child processes until ``seconds`` or ``runs`` are spent or a
    finding is confirmed; the result from libFuzzer's log and artifacts. libFuzzer
    stops at a timeout: one that does not replay (:func:`replays_in_time`) is moved
    to ``unconfirmed/`` and fuzzing goes on from the corpus reached."""
    folder = FUZZ_OUT / name
    (folder / "corpus").mkdir(parents=True, exist_ok=True)
    aside = folder / "unconfirmed"
    shutil.rmtree(aside, ignore_errors=True)
    for stale in _artifacts(folder):  # the findings reported are this run's
        stale.unlink()
    log = folder / "fuzz.log"
    log.write_bytes(b"")
    result = Result(name, log=str(log))
    started = time.monotonic()
    while True:
        left_s, left_runs = seconds - int(time.monotonic() - started), runs - result.executions
        logged = log.stat().st_size
        code, error = _fuzz(name, max(1, left_s), left_runs, log)
        _add_progress(result, log.read_bytes()[logged:].decode(errors="replace"))
        unconfirmed = [p for p in _artifacts(folder) if p.name.startswith("timeout-") and replays_in_time(name, p)]
        for path in unconfirmed:
            aside.mkdir(exist_ok=True)
            result.unconfirmed.append(str(path.rename(aside / path.name)))
        result.findings = [str(p) for p in _artifacts(folder)]
        if code and not result.findings and not unconfirmed:
            error = error or f"exit status {code} without a finding (see {log})"
        result.error = error
        if result.findings or error or not unconfirmed or seconds - (time.monotonic() - started) < MIN_SEGMENT_S \
                or result.executions >= runs:
            break
    result.seconds = round(time.monotonic() - started, 1)
    return result


def _fuzz(name: str, seconds: int, runs: int, log: Path) -> tuple[int | None, str | None]:
    """One libFuzzer process, its output appended to ``log``: its exit status, and
    an error if it had to be killed."""
    command = [sys.executable, "-m", "tests.fuzz", "--worker", name, "--seconds", str(seconds), "--runs", str(runs)]
    with log.open("ab") as out:
        try:
            return subprocess.run(command, stdout=out, stderr=subprocess.STDOUT,
                                  timeout=seconds + STARTUP_GRACE_S).returncode, None
        except subprocess.TimeoutExpired:
            return None, f"still running {seconds + STARTUP_GRACE_S}s after it started: killed"


def replays_in_time(name: str, path: Path) -> bool:
    """Whether a timeout's input runs within ``MAX_SECONDS`` (the best of
    :data:`CONFIRM_TRIES`, in a fresh process) and keeps the target's rule."""
    command = [sys.executable, "-m", "tests.fuzz", "--worker", name, "--confirm", str(path)]
    try:
        return subprocess.run(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              timeout=CONFIRM_TRIES * MAX_SECONDS + STARTUP_GRACE_S).returncode == 0
    except subprocess.TimeoutExpired:
        return False


def confirm_in_this_process(name: str, path: Path) -> int:
    """The replay of :func:`replays_in_time`: 0 when the input is not slow."""
    from tests.fuzz.target import Finding, check, targets

    fuzz_target, data = targets()[name], path.read_bytes()
    best = math.inf
    for _ in range(CONFIRM_TRIES):
        start = time.perf_counter()
        try:
            check(fuzz_target, data)
        except Finding:
            return 1
        best = min(best, time.perf_counter() - start)
    print(f"{path}: best of {CONFIRM_TRIES} runs {best:.3f}s", file=sys.stderr)
    return 0 if best <= MAX_SECONDS else 1


def _artifacts(folder: Path) -> list[Path]:
    return sorted(p for p in folder.iterdir() if p.is_file() and p.name.startswith(ARTIFACTS))


def _add_progress(result: Result, text: str) -> None:
    """Add one libFuzzer process's executions (its final stats, else its last
    status line) to ``result``; take its coverage and corpus size."""
    statuses = _STATUS.findall(text)
    executed = _EXECUTED.findall(text)
    if statuses:
        _, result.coverage, result.features, result.corpus = map(int, statuses[-1])
    if executed:
        result.executions += int(executed[-1])
    elif statuses:
        result.executions += int(statuses[-1][0])


HEADER = f"{'target':<20} {'executions':>11} {'seconds':>8} {'exec/s':>8} {'cov':>6} {'ft':>7} {'corpus':>7}  result"


def row(r: Result) -> str:
    """The table row of one target's result (under :data:`HEADER`)."""
    rate = r.executions / r.seconds if r.seconds else 0.0
    outcome = f"{len(r.findings)} finding(s): {', '.join(r.findings)}" if r.findings else r.error or "ok"
    if r.unconfirmed:
        outcome += f" ({len(r.unconfirmed)} timeout(s) not reproduced, in {Path(r.unconfirmed[0]).parent}/)"
    return (f"{r.target:<20} {r.executions:>11} {r.seconds:>8.0f} {rate:>8.0f} {r.coverage or 0:>6} "
            f"{r.features or 0:>7} {r.corpus or 0:>7}  {outcome}")


def main(argv: list[str] | None = None) -> int:
    """Run the campaign (or, with ``--worker``, one target inside this process)."""
    parser = argparse.ArgumentParser(prog="python -m tests.fuzz", description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=int, default=DEFAULT_SECONDS, help="per target (default %(default)s)")
    parser.add_argument("--runs", type=int, default=DEFAULT_RUNS,
                        help="executions per target at most (default %(default)s)")
    parser.add_argument("--only", nargs="+", metavar="NAME", help="these targets only")
    parser.add_argument("--jobs", type=int, default=1, help="targets fuzzed at once (default %(default)s)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--confirm", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker and args.confirm:
        return confirm_in_this_process(args.worker, args.confirm)
    if args.worker:
        fuzz_in_this_process(args.worker, args.seconds, args.runs)
        return 0
    from tests.fuzz.target import targets

    names = list(targets())
    unknown = sorted(set(args.only or ()) - set(names))
    if unknown:
        parser.error(f"unknown targets {unknown}; known: {', '.join(names)}")
    chosen = [n for n in names if not args.only or n in args.only]
    print(f"fuzzing {len(chosen)} target(s), {args.seconds}s or {args.runs} executions each; "
          f"output in {FUZZ_OUT}/", flush=True)
    print(HEADER, flush=True)
    results = []
    with ThreadPoolExecutor(max(1, args.jobs)) as pool:
        for result in pool.map(lambda n: run_target(n, args.seconds, args.runs), chosen):
            print(row(result), flush=True)
            results.append(result)
    REPORT.parent.mkdir(parents=True, exist_ok=True)
    REPORT.write_text(json.dumps([{**asdict(r), "failed": r.failed} for r in results], indent=2) + "\n")
    return 1 if any(r.failed for r in results) else 0
