"""The fuzz corpora and regressions, replayed in ``make test``: every input keeps
its target's rule (parses, or raises a documented error), within
:data:`~tests.fuzz.target.MAX_SECONDS` and :data:`~tests.fuzz.target.MAX_ALLOCATION_BYTES`.
``make fuzz`` searches for new inputs; this keeps the ones found."""

from __future__ import annotations

import time
import tracemalloc
from pathlib import Path

import pytest

from tests.fuzz.target import CORPUS, MAX_ALLOCATION_BYTES, MAX_SECONDS, REGRESSIONS, check, inputs, targets

TARGETS = targets()
CASES = [(name, path) for name in TARGETS for path in inputs(name)]


@pytest.mark.parametrize(("name", "path"), CASES, ids=[f"{n}/{p.parent.parent.name}/{p.name}" for n, p in CASES])
def test_input_keeps_its_targets_rule(name: str, path: Path) -> None:
    data = path.read_bytes()
    # Once to pay what a process pays once (lazy imports, compiled templates), then
    # timed untraced (tracemalloc slows allocation-heavy code several-fold), then
    # traced for the allocation peak.
    check(TARGETS[name], data)
    # CPU seconds, not wall seconds: the rule is about the parser's work, and a
    # busy 2-core machine (make test runs two lanes) stretches wall time several-fold.
    start = time.process_time()
    check(TARGETS[name], data)
    seconds = time.process_time() - start
    assert seconds <= MAX_SECONDS, f"{path} took {seconds:.2f} CPU seconds"
    tracemalloc.start()
    try:
        check(TARGETS[name], data)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak <= MAX_ALLOCATION_BYTES, f"{path} made the parser allocate {peak} bytes"


def test_every_target_has_a_corpus() -> None:
    empty = [name for name in TARGETS if not any(p.is_file() for p in (CORPUS / name).glob("*"))]
    assert not empty, f"no corpus (python -m tests.fuzz.seed): {empty}"


def test_corpus_and_regression_folders_name_targets() -> None:
    for root in (CORPUS, REGRESSIONS):
        folders = {p.name for p in root.iterdir() if p.is_dir()} if root.is_dir() else set()
        assert folders <= set(TARGETS), f"{root}: folders of no target: {sorted(folders - set(TARGETS))}"
    assert {p.name for p in CORPUS.iterdir() if p.is_dir()} == set(TARGETS)


def test_every_target_says_what_it_parses() -> None:
    assert all(t.doc for t in TARGETS.values())
