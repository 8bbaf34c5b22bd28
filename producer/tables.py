"""Columnar inputs read with pyarrow (Parquet, Arrow IPC/Feather) and
``datasets`` (``save_to_disk`` directories), batch by batch.

Each reader is a context manager that opens and checks its input on entry (so
a bad file is a :class:`~hsx.runtime.errors.UsageError` before anything is
published) and yields an iterator of :class:`~hsx.producer.sources.SourceLine`.
Memory stays bounded by one batch: Parquet is read ``batch_rows`` rows at a
time, Arrow files and ``datasets`` directories are memory-mapped and sliced.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.ipc
import pyarrow.parquet as pq

from hsx.producer.sources import SourceLine, record_line
from hsx.runtime.errors import UsageError

BATCH_ROWS = 1024
"""Rows turned into Python objects at a time: small enough for long
conversations, large enough that pyarrow's per-batch cost does not show."""

PARQUET_READ_BUFFER = 1 << 20
"""Bytes read at a time from a Parquet column chunk."""

HF_DISK_MARKERS = ("dataset_info.json", "dataset_dict.json")
"""Files ``datasets.save_to_disk`` writes: a Dataset, a DatasetDict."""


@contextmanager
def read_parquet(path: Path, batch_rows: int = BATCH_ROWS) -> Iterator[Iterator[SourceLine]]:
    """The rows of a Parquet file, ``batch_rows`` at a time (never the whole file)."""
    try:
        # pre_buffer (pyarrow's default) would read every row group ahead, the
        # whole file; buffered reads stream even a single huge row group.
        parquet = pq.ParquetFile(path, pre_buffer=False, buffer_size=PARQUET_READ_BUFFER)
    except (pa.ArrowException, OSError, UnicodeDecodeError) as exc:  # the last: a column name not UTF-8
        raise UsageError(f"cannot read {path} as Parquet: {exc}") from exc
    try:
        yield _lines(path.name, parquet.iter_batches(batch_size=batch_rows), batch_rows, path, "Parquet")
    finally:
        parquet.close()


@contextmanager
def read_arrow(path: Path, batch_rows: int = BATCH_ROWS) -> Iterator[Iterator[SourceLine]]:
    """The rows of an Arrow IPC file (Feather v2) or IPC stream (as in a
    ``datasets`` cache), memory-mapped, record batch by record batch."""
    try:
        source = pa.memory_map(str(path))
    except OSError as exc:
        raise UsageError(f"cannot read {path}: {exc}") from exc
    try:
        yield _lines(path.name, _ipc_batches(source, path), batch_rows, path, "Arrow")
    finally:
        source.close()


def _ipc_batches(source: pa.MemoryMappedFile, path: Path) -> Iterator[pa.RecordBatch]:
    """Opens the reader now (a bad file fails on entry), reads batches later."""
    # The file format (Feather v2, .arrow from pyarrow) has a footer; the stream
    # format (datasets' .arrow) has none. Try the one, then the other.
    # Any pyarrow error (ArrowException: invalid, not implemented such as a 1-bit
    # integer type, ...) or OSError (a footer that fails verification) is a bad file.
    try:
        reader = pa.ipc.open_file(source)
    except (pa.ArrowException, OSError):
        source.seek(0)
        try:
            return iter(pa.ipc.open_stream(source))
        except (pa.ArrowException, OSError) as exc:
            raise UsageError(f"cannot read {path} as Arrow IPC (file or stream format): {exc}") from exc
    return (reader.get_batch(index) for index in range(reader.num_record_batches))


@contextmanager
def read_hf_disk(path: Path, split: str | None, batch_rows: int = BATCH_ROWS) -> Iterator[Iterator[SourceLine]]:
    """The rows of a directory written by ``datasets.save_to_disk``: a Dataset,
    or one split of a DatasetDict (``split``, needed when it has several)."""
    try:
        import datasets  # lazy: a large import, and an optional extra
    except ImportError as exc:
        raise UsageError(f"{path} is a datasets.save_to_disk directory; reading it needs the datasets "
                         "package: pip install 'hsx[datasets]'") from exc
    _check_names_stay_inside(path)
    try:
        loaded = datasets.load_from_disk(str(path))  # memory-mapped Arrow, not loaded into memory
    except (OSError, ValueError, pa.ArrowException, KeyError, TypeError, AttributeError) as exc:
        # datasets reads the folder's JSON files without checking their shape: a damaged
        # one fails with whatever its parser meets first (a str where it wants a dict...).
        raise UsageError(f"cannot read {path} as a datasets.save_to_disk directory: "
                         f"{type(exc).__name__}: {exc}") from exc
    name = path.resolve().name
    if isinstance(loaded, datasets.DatasetDict):
        split = _pick_split(path, list(loaded), split)
        loaded, name = loaded[split], f"{name}/{split}"
    elif split is not None:
        raise UsageError(f"--split {split}: {path} is a single Dataset, not a DatasetDict with splits")
    tables = loaded.with_format("arrow").iter(batch_size=batch_rows)
    yield _lines(name, tables, batch_rows, path, "the dataset")


def _check_names_stay_inside(path: Path) -> None:
    """datasets joins the split names of ``dataset_dict.json`` and the file names
    of each ``state.json`` to the folder and opens what they name: a name that is
    a path (``../../x.arrow``, ``/etc/...``) would read outside the folder. JSON
    of another shape is left to datasets, whose errors say so."""
    def path_like(name: object) -> bool:
        return isinstance(name, str) and (name in ("", ".", "..") or any(c in name for c in "/\\"))

    def listed(file: Path, key: str) -> list[Any]:
        try:
            value = json.loads(file.read_bytes()).get(key, []) if file.is_file() else []
        except (OSError, ValueError, AttributeError):
            return []
        return value if isinstance(value, list) else []

    folders = [path]
    splits = listed(path / "dataset_dict.json", "splits")
    if splits:
        if bad := [s for s in splits if path_like(s)]:
            raise UsageError(f"cannot read {path} as a datasets.save_to_disk directory: dataset_dict.json names "
                             f"split {bad[0]!r}, not a folder name inside it")
        folders = [path / s for s in splits if isinstance(s, str)]
    for folder in folders:
        names = [entry.get("filename") for entry in listed(folder / "state.json", "_data_files")
                 if isinstance(entry, dict)]
        if bad := [n for n in names if path_like(n)]:
            raise UsageError(f"cannot read {path} as a datasets.save_to_disk directory: "
                             f"{(folder / 'state.json').relative_to(path)} names data file {bad[0]!r}, "
                             "not a file name inside its folder")


def _pick_split(path: Path, splits: list[str], split: str | None) -> str:
    if split in splits:
        return split
    if split is None and len(splits) == 1:
        return splits[0]
    listed = ", ".join(splits) or "none"
    if split is None:
        raise UsageError(f"{path} has several splits, pick one with --split ({listed})")
    raise UsageError(f"--split {split}: {path} has no such split (it has: {listed})")


def _lines(source: str, batches: Iterable[pa.RecordBatch | pa.Table], batch_rows: int, path: Path,
           what: str) -> Iterator[SourceLine]:
    row_no = 0
    for records in _records(batches, batch_rows, path, what):
        for record in records:
            row_no += 1
            yield record_line(source, row_no, record, drop_nulls=True)


def _records(batches: Iterable[pa.RecordBatch | pa.Table], batch_rows: int, path: Path,
             what: str) -> Iterator[list[dict[str, Any]]]:
    """The rows of ``batches`` as Python dicts, a slice of ``batch_rows`` at a
    time (a record batch may hold a whole file). What pyarrow cannot read or
    convert is one usage error: a corrupt page, a damaged batch, a string or
    column name that is not UTF-8, a struct with duplicate field names, a date
    beyond Python's, a type without a Python form; so are
    rows that hold no data at all (no column, or only null-typed ones), whose
    count no byte of the file backs: a few bytes could declare billions."""
    try:
        for batch in batches:
            # pyarrow trusts a file's offsets: converting a damaged batch to Python
            # would read past its buffers (a segfault).
            batch.validate(full=True)
            if batch.num_rows and not batch.nbytes:
                raise UsageError(f"cannot read {path} as {what}: a batch of {batch.num_rows} rows without data "
                                 f"(columns: {', '.join(batch.schema.names) or 'none'}, none holding a byte)")
            for offset in range(0, batch.num_rows, batch_rows):
                yield batch.slice(offset, batch_rows).to_pylist()
    except (pa.ArrowException, OSError, ValueError, OverflowError) as exc:  # the last two: conversions to Python
        raise UsageError(f"cannot read {path} as {what}: {exc}") from exc
    except KeyError as exc:  # pyarrow has no Python class for a column's type
        raise UsageError(f"cannot read {path} as {what}: a column of a type pyarrow cannot convert "
                         f"(type id {exc})") from exc
