"""Prompt inputs in the formats datasets come in, as one stream of
:class:`~hsx.producer.sources.SourceLine` whatever the format.

Kinds (:class:`InputKind`) are told apart by the path: ``.jsonl``/``.ndjson``
and ``-`` (standard input), ``.json`` (one array of rows, streamed with
ijson), ``.parquet``, ``.arrow``/``.feather``/``.ipc``, and a directory
written by ``datasets.save_to_disk``. Every kind is read in bounded memory;
``--shuffle`` uses a buffer of :data:`SHUFFLE_BUFFER` rows.

Row numbers (and so generated request ids) come from the position in the file
or split, before shuffling and limiting: the same file gives the same ids.
"""

from __future__ import annotations

import errno
import itertools
import os
import random
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import IO

import ijson

from hsx.producer.sources import SourceLine, read_jsonl, record_line
from hsx.producer.tables import HF_DISK_MARKERS, read_arrow, read_hf_disk, read_parquet
from hsx.runtime.errors import UsageError

SHUFFLE_BUFFER = 10_000
"""Rows held for ``--shuffle``: an input up to this size is shuffled uniformly;
a larger one is shuffled within a sliding window of this many rows (as
``datasets.IterableDataset.shuffle`` does), so memory stays bounded."""

STDIN = "-"


class InputKind(str, Enum):
    """Input file formats (``--input-format``)."""

    JSONL = "jsonl"
    JSON = "json"
    """One JSON array of row objects (ShareGPT files)."""
    PARQUET = "parquet"
    ARROW = "arrow"
    """Arrow IPC, file format (Feather v2) or stream format."""
    HF_DISK = "hf-disk"
    """A directory written by ``datasets.save_to_disk``."""


EXTENSIONS = {
    ".jsonl": InputKind.JSONL,
    ".ndjson": InputKind.JSONL,
    ".json": InputKind.JSON,
    ".parquet": InputKind.PARQUET,
    ".arrow": InputKind.ARROW,
    ".feather": InputKind.ARROW,
    ".ipc": InputKind.ARROW,
}


@dataclass(frozen=True)
class InputSpec:
    """Which rows to read, from where, in which order."""

    path: str
    """A file or ``datasets`` directory, or ``-`` for standard input (JSONL or JSON)."""
    kind: InputKind | None = None
    """``None``: from the path (:func:`detect_kind`)."""
    split: str | None = None
    """The split of a ``datasets`` DatasetDict; an error for any other input."""
    limit: int | None = None
    """At most this many rows (after shuffling), valid or not."""
    shuffle: bool = False
    seed: int = 0
    """Seeds the shuffle: the same seed gives the same order."""


def detect_kind(path: str, kind: InputKind | None = None) -> InputKind:
    """The kind of input at ``path``: ``kind`` if given, else from the path.
    Raises :class:`UsageError` for a missing path or one no kind fits."""
    if path == STDIN:
        kind = kind or InputKind.JSONL
        if kind not in (InputKind.JSONL, InputKind.JSON):
            raise UsageError(f"--input-format {kind.value} needs a file, not standard input")
        return kind
    where = Path(path)
    if not where.exists():
        raise UsageError(f"cannot read {path}: {os.strerror(errno.ENOENT)}")
    if where.is_dir():
        if kind not in (None, InputKind.HF_DISK):
            raise UsageError(f"--input-format {kind.value}: {path} is a directory")
        if not any((where / marker).is_file() for marker in HF_DISK_MARKERS):
            raise UsageError(f"{path} is a directory but not one written by datasets.save_to_disk "
                             f"(no {' or '.join(HF_DISK_MARKERS)}); give a file")
        return InputKind.HF_DISK
    if kind is InputKind.HF_DISK:
        raise UsageError(f"--input-format hf-disk: {path} is a file, not a datasets.save_to_disk directory")
    if kind is not None:
        return kind
    try:
        return EXTENSIONS[where.suffix.lower()]
    except KeyError:
        known = ", ".join(EXTENSIONS)
        raise UsageError(f"{path}: unknown extension {where.suffix!r} (known: {known}); "
                         "say what it is with --input-format jsonl|json|parquet|arrow") from None


def check_input(spec: InputSpec) -> InputKind:
    """The input's kind, once everything that can be checked without reading
    rows is: the path, the flags, and (for files) that it opens as its kind.
    Raises :class:`UsageError` saying what is wrong."""
    kind = _kind_of(spec)
    if spec.path != STDIN:  # opening standard input as JSON would consume it
        with _open_kind(spec.path, kind, spec.split):
            pass
    return kind


@contextmanager
def open_input(spec: InputSpec) -> Iterator[Iterator[SourceLine]]:
    """Open and check the input on entry (a :class:`UsageError` for any problem
    found before reading rows), then yield its rows lazily, shuffled and
    limited as ``spec`` says. Files are closed on exit."""
    with _open_kind(spec.path, _kind_of(spec), spec.split) as lines:
        if spec.shuffle:
            lines = shuffled(lines, spec.seed)
        if spec.limit is not None:
            lines = itertools.islice(lines, spec.limit)
        yield lines


def read_input(spec: InputSpec) -> Iterator[SourceLine]:
    """The rows of :func:`open_input` as one generator (opened on first use)."""
    with open_input(spec) as lines:
        yield from lines


class InputRows:
    """An input's rows as an iterable: checked when made (:func:`check_input`),
    so a bad input fails before anything starts; read when iterated, each
    iteration from the start (standard input can be read only once)."""

    def __init__(self, spec: InputSpec) -> None:
        self.spec = spec
        self.kind = check_input(spec)

    def __iter__(self) -> Iterator[SourceLine]:
        return read_input(self.spec)


def _kind_of(spec: InputSpec) -> InputKind:
    kind = detect_kind(spec.path, spec.kind)
    if spec.split is not None and kind is not InputKind.HF_DISK:
        raise UsageError(f"--split {spec.split}: only a datasets.save_to_disk directory has splits, "
                         f"{spec.path} is {kind.value}")
    if spec.limit is not None and spec.limit < 0:
        raise UsageError(f"--limit must not be negative, got {spec.limit}")
    return kind


def shuffled(lines: Iterator[SourceLine], seed: int, buffer_rows: int = SHUFFLE_BUFFER) -> Iterator[SourceLine]:
    """A seeded, deterministic shuffle holding at most ``buffer_rows`` rows: each
    new row takes the place of a randomly chosen buffered one, which is yielded."""
    rng = random.Random(seed)
    buffer: list[SourceLine] = []
    for line in lines:
        if len(buffer) < buffer_rows:
            buffer.append(line)
            continue
        index = rng.randrange(buffer_rows)
        yield buffer[index]
        buffer[index] = line
    rng.shuffle(buffer)
    yield from buffer


@contextmanager
def _open_kind(path: str, kind: InputKind, split: str | None) -> Iterator[Iterator[SourceLine]]:
    if kind is InputKind.PARQUET:
        with read_parquet(Path(path)) as lines:
            yield lines
    elif kind is InputKind.ARROW:
        with read_arrow(Path(path)) as lines:
            yield lines
    elif kind is InputKind.HF_DISK:
        with read_hf_disk(Path(path), split) as lines:
            yield lines
    else:
        with _open_stream(path) as (stream, source):
            yield read_jsonl(stream, source) if kind is InputKind.JSONL else read_json_array(stream, source)


@contextmanager
def _open_stream(path: str) -> Iterator[tuple[IO[bytes], str]]:
    if path == STDIN:
        yield sys.stdin.buffer, "stdin"
        return
    try:
        stream = open(path, "rb")
    except OSError as exc:
        raise UsageError(f"cannot read {path}: {exc.strerror}") from exc
    with stream:
        yield stream, Path(path).name


def read_json_array(stream: IO[bytes], source: str) -> Iterator[SourceLine]:
    """The elements of a top-level JSON array, parsed one at a time (a large
    ShareGPT file is never held whole). Numbers with a fraction become floats,
    so a row's JSON is what orjson gives for the same row in a JSONL file.
    The top level is checked now, the rows are read as they are asked for."""
    events = ijson.parse(stream, use_float=True)
    try:
        first = next(events, None)
    except (ijson.JSONError, UnicodeDecodeError) as exc:  # the last: a string that is not UTF-8
        raise UsageError(f"{source}: not valid JSON: {exc}") from exc
    if first is None or first[1] != "start_array":
        found = "nothing" if first is None else f"a JSON {_JSON_KIND.get(first[1], first[1])}"
        raise UsageError(f"{source}: a .json input must be one JSON array of rows, found {found}; "
                         "for one JSON object per line use --input-format jsonl")
    return _json_rows(itertools.chain([first], events), source)


def _json_rows(events: Iterator[tuple[str, str, object]], source: str) -> Iterator[SourceLine]:
    row_no = 0
    try:
        for record in ijson.items(events, "item"):
            row_no += 1
            yield record_line(source, row_no, record)
    except (ijson.JSONError, UnicodeDecodeError) as exc:
        raise UsageError(f"{source}: not valid JSON after row {row_no}: {exc}") from exc


_JSON_KIND = {"start_map": "object", "string": "string", "number": "number", "boolean": "boolean", "null": "null"}
