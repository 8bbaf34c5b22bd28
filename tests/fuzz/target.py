"""The contract of a fuzz target: one parser of untrusted bytes, and the error
classes it documents.

A target takes the bytes as they would come from outside (a Kafka record, a
staged object, a shard file, a line of an input file) and hands them to the very
function the service uses. The rule every target checks (:func:`check`): the
input parses, or it raises one of the target's ``expected`` classes (the ones
that lead to a dead letter or a one-line error). Anything else escaping is a
finding; so is an input that takes more than :data:`MAX_SECONDS`, or one that
makes the parser allocate more than :data:`MAX_ALLOCATION_BYTES` (the
replay in ``make test`` measures it with tracemalloc, ``make fuzz`` with
libFuzzer's RSS limit).

Targets register themselves with :func:`target` in the modules listed in
:data:`MODULES`; corpora live in ``tests/fuzz/corpus/<name>/`` (seeds from real
records) and every input that ever found a defect in
``tests/fuzz/regressions/<name>/`` (one file per finding, named for it).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).parent
CORPUS = HERE / "corpus"
REGRESSIONS = HERE / "regressions"
MODULES = ("tests.fuzz.wire", "tests.fuzz.files")
"""The modules whose imports register targets."""

MAX_SECONDS = 1.0
"""The most one input may take."""
MAX_ALLOCATION_BYTES = 256 << 20
"""The most one input may make a parser allocate: the targets run their parsers
under limits (sample size, event size) far below it, so that anything above it
was sized from a declared length before that length was checked."""


@dataclass(frozen=True)
class Target:
    name: str
    run: Callable[[bytes], object]
    """Parses ``data`` as the service would; returns anything, raises only ``expected``."""
    expected: tuple[type[BaseException], ...]
    """The documented error classes: what leads to a dead letter or a clear error."""
    doc: str


_TARGETS: dict[str, Target] = {}


def target(name: str, *expected: type[BaseException]) -> Callable[[Callable[[bytes], object]], Callable[[bytes], object]]:
    """Register ``run`` as the fuzz target ``name``; its docstring says what it parses."""

    def register(run: Callable[[bytes], object]) -> Callable[[bytes], object]:
        if name in _TARGETS:
            raise ValueError(f"fuzz target {name!r} registered twice")
        _TARGETS[name] = Target(name, run, tuple(expected), (run.__doc__ or "").strip().splitlines()[0])
        return run

    return register


def targets() -> dict[str, Target]:
    """Every registered target, by name (imports :data:`MODULES` first)."""
    for module in MODULES:
        importlib.import_module(module)
    return dict(sorted(_TARGETS.items()))


class Finding(AssertionError):
    """An input broke a target's rule."""


def check(fuzz_target: Target, data: bytes) -> None:
    """Run one input; :class:`Finding` if anything but an expected error escapes."""
    try:
        fuzz_target.run(data)
    except fuzz_target.expected:
        pass
    except Exception as exc:
        raise Finding(f"{fuzz_target.name}: {type(exc).__name__}: {exc}"[:2000]) from exc


def inputs(name: str) -> list[Path]:
    """The corpus and regression files of target ``name``, sorted."""
    return sorted(p for folder in (CORPUS / name, REGRESSIONS / name) if folder.is_dir()
                  for p in folder.iterdir() if p.is_file())
