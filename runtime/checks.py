"""Checks of command-line values that need neither the network nor an engine, so
that every ``hsx`` command rejects a bad invocation at once, in one line naming
the flag, the value and the rule, before it contacts Kafka or starts vLLM.

Two kinds:

* argparse ``type=`` functions (:func:`integer`, :func:`number`, :func:`bounded`,
  :func:`enum_value`): they parse a value and raise ``ArgumentTypeError``, which
  argparse prefixes with the flag (``argument --max-inflight: ...``).
* checks of local state (:func:`model_dir`, :func:`writable_dir`, ...), called at
  the start of a command's ``run(args)``: they raise :class:`UsageError`
  (exit 2) with a message that starts with the flag and the value.
"""

from __future__ import annotations

import argparse
import math
import os
from collections.abc import Callable
from enum import Enum
from pathlib import Path
from typing import TypeVar

import annotated_types
from pydantic import BaseModel

from hsx.runtime.errors import UsageError

E = TypeVar("E", bound=Enum)

MIN_FREE_BYTES = 4096
"""Free space an output needs to start at all: less than one block means the disk
is full (a shard, an index or an export file would fail at its first write). A
nearly full disk is not refused: the sink keeps what it cannot write and retries
(tests/reliability/test_storage_faults.py fills a 64 KiB file system mid-run)."""
WEIGHT_PATTERNS = ("*.safetensors", "*.bin")
"""The weight files a Hugging Face model directory holds (sharded or not)."""


def integer(low: int | None = None, high: int | None = None) -> Callable[[str], int]:
    """A ``type=`` for an integer within ``[low, high]`` (either side open when ``None``)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"wants an integer, got {text!r}") from None
        _in_range(value, low, high)
        return value

    return parse


def number(low: float | None = None, *, above: float | None = None) -> Callable[[str], float]:
    """A ``type=`` for a number of seconds (or any float): at least ``low``, or more
    than ``above``; ``inf`` is allowed (for ever), NaN is not."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"wants a number, got {text!r}") from None
        if math.isnan(value):
            raise argparse.ArgumentTypeError(f"wants a number, got {text!r}")
        if above is not None and not value > above:
            raise argparse.ArgumentTypeError(f"must be more than {above:g}, got {text}")
        _in_range(value, low, None)
        return value

    return parse


def bounded(model: type[BaseModel], field: str) -> Callable[[str], int]:
    """:func:`integer` within the bounds that the pydantic ``model`` declares for
    ``field`` (``Field(ge=...)``, ``Annotated[int, Field(le=...)]``), so a bound is
    written once, where the value is validated anyway."""
    low = high = None
    for bound in model.model_fields[field].metadata:
        if isinstance(bound, annotated_types.Ge):
            low = int(bound.ge)
        elif isinstance(bound, annotated_types.Gt):
            low = int(bound.gt) + 1
        elif isinstance(bound, annotated_types.Le):
            high = int(bound.le)
        elif isinstance(bound, annotated_types.Lt):
            high = int(bound.lt) - 1
    return integer(low, high)


def enum_value(kind: type[E]) -> Callable[[str], E]:
    """A ``type=`` for one of an enum's values; the error lists them (argparse's
    own would say only ``invalid Codec value``)."""

    def parse(text: str) -> E:
        try:
            return kind(text)
        except ValueError:
            known = ", ".join(str(member.value) for member in kind)
            raise argparse.ArgumentTypeError(f"must be one of {known}; got {text!r}") from None

    return parse


def _in_range(value: float, low: float | None, high: float | None) -> None:
    if low is not None and value < low:
        raise argparse.ArgumentTypeError(f"must be at least {_shown(low)}, got {_shown(value)}")
    if high is not None and value > high:
        raise argparse.ArgumentTypeError(f"must be at most {_shown(high)}, got {_shown(value)}")


def _shown(value: float) -> str:
    return str(value) if isinstance(value, int) else f"{value:g}"  # a byte count stays 5242880, not 5.24288e+06


def model_dir(flag: str, value: str | Path) -> Path:
    """A local model directory with ``config.json`` and weights. A hub id is never
    looked up: hsx downloads nothing, so anything else is a usage error here,
    before transformers or vLLM could take it for a repository name."""
    path = Path(value)
    if not path.exists():
        raise UsageError(f"{flag} {value}: no such directory (a local model directory with config.json and "
                         "weights; hsx downloads nothing)")
    if not path.is_dir():
        raise UsageError(f"{flag} {value}: not a directory (a model directory holds config.json and weights)")
    if not (path / "config.json").is_file():
        raise UsageError(f"{flag} {value}: no config.json in it; not a model directory")
    if not any(next(path.glob(pattern), None) for pattern in WEIGHT_PATTERNS):
        raise UsageError(f"{flag} {value}: no weights in it ({' or '.join(WEIGHT_PATTERNS)})")
    return path


def existing_dir(flag: str, value: str | Path, holds: str, what: str) -> Path:
    """A directory that exists and holds ``holds`` (a file or folder that marks it
    as ``what``, e.g. a dataset's ``index``)."""
    path = Path(value)
    if not path.exists():
        raise UsageError(f"{flag} {value}: no such directory ({what})")
    if not path.is_dir():
        raise UsageError(f"{flag} {value}: not a directory ({what})")
    if not (path / holds).exists():
        raise UsageError(f"{flag} {value}: no {holds} in it, so not {what}")
    return path


def writable_dir(flag: str, value: str | Path) -> Path:
    """A directory that is, or can be created, writable with room to start: the
    path or its nearest existing parent must be a writable directory on a real
    filesystem with :data:`MIN_FREE_BYTES` free. Nothing is created or written."""
    path = Path(value)
    if path.exists() and not path.is_dir():
        raise UsageError(f"{flag} {value}: exists and is not a directory")
    _room_in(flag, value, _nearest_existing(path))
    return path


def writable_file(flag: str, value: str | Path) -> Path:
    """A file to be written (e.g. ``--stats-file``): not a directory, in an
    existing writable directory."""
    path = Path(value)
    if path.is_dir():
        raise UsageError(f"{flag} {value}: is a directory, not a file")
    parent = path.absolute().parent
    if not parent.is_dir():
        raise UsageError(f"{flag} {value}: no directory {parent} to write it in")
    _room_in(flag, value, parent)
    return path


def new_dir(flag: str, value: str | Path) -> Path:
    """A directory that must not exist yet and can be created (an export's output)."""
    path = Path(value)
    if path.exists() or path.is_symlink():
        raise UsageError(f"{flag} {value}: exists; choose a new directory")
    return writable_dir(flag, path)


def outside(flag: str, value: str | Path, input_flag: str, input_path: str | Path) -> None:
    """An output must not lie inside (or be) an input directory: hsx never writes
    into what it reads."""
    output, source = Path(value).resolve(), Path(input_path).resolve()
    if source.is_dir() and output.is_relative_to(source):
        raise UsageError(f"{flag} {value}: inside {input_flag} {input_path}; write the output somewhere else")


def _nearest_existing(path: Path) -> Path:
    for candidate in (path.absolute(), *path.absolute().parents):
        if candidate.exists():
            return candidate
    return Path("/")


def _room_in(flag: str, value: str | Path, directory: Path) -> None:
    if not directory.is_dir():
        raise UsageError(f"{flag} {value}: {directory} is a file, not a directory")
    if not os.access(directory, os.W_OK | os.X_OK):
        raise UsageError(f"{flag} {value}: {directory} is not writable")
    stat = os.statvfs(directory)
    if stat.f_flag & os.ST_RDONLY:
        raise UsageError(f"{flag} {value}: {directory} is on a read-only filesystem")
    if stat.f_blocks == 0:  # /proc, /sys: directories of a filesystem that stores nothing
        raise UsageError(f"{flag} {value}: {directory} is on a virtual filesystem that cannot hold files")
    free = stat.f_bavail * stat.f_frsize
    if free < MIN_FREE_BYTES:
        raise UsageError(f"{flag} {value}: the disk is full ({free:,} bytes free in {directory}, "
                         f"at least {MIN_FREE_BYTES} bytes needed to start)")
