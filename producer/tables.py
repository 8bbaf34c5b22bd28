"""Columnar inputs read with pyarrow (Parquet, Arrow IPC/Feather) and
``datasets`` (``save_to_disk`` directories), batch by batch.

Each reader is a context manager that opens and checks its input on entry (so
a bad file is a :class:`~hsx.runtime.errors.UsageError` before anything is
published) and yields an iterator of :class:`~hsx.producer.sources.SourceLine`.
Memory stays bounded by one batch: Parquet is read ``batch_rows`` rows at a
time, Arrow files and ``datasets`` directories are memory-mapped and sliced.
"""

from __future__ import annotations

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
    except (pa.ArrowException, OSError) as exc:
        raise UsageError(f"cannot read {path} as Parquet: {exc}") from exc
    try:
        yield _lines(path.name, _guarded(parquet.iter_batches(batch_size=batch_rows), path, "Parquet"), batch_rows)
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
        yield _lines(path.name, _guarded(_ipc_batches(source, path), path, "Arrow"), batch_rows)
    finally:
        source.close()


def _ipc_batches(source: pa.MemoryMappedFile, path: Path) -> Iterator[pa.RecordBatch]:
    """Opens the reader now (a bad file fails on entry), reads batches later."""
    # The file format (Feather v2, .arrow from pyarrow) has a footer; the stream
    # format (datasets' .arrow) has none. Try the one, then the other.
    try:
        reader = pa.ipc.open_file(source)
    except pa.ArrowInvalid:
        source.seek(0)
        try:
            return iter(pa.ipc.open_stream(source))
        except pa.ArrowInvalid as exc:
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
    try:
        loaded = datasets.load_from_disk(str(path))  # memory-mapped Arrow, not loaded into memory
    except (FileNotFoundError, ValueError, pa.ArrowException) as exc:
        raise UsageError(f"cannot read {path} as a datasets.save_to_disk directory: {exc}") from exc
    name = path.resolve().name
    if isinstance(loaded, datasets.DatasetDict):
        split = _pick_split(path, list(loaded), split)
        loaded, name = loaded[split], f"{name}/{split}"
    elif split is not None:
        raise UsageError(f"--split {split}: {path} is a single Dataset, not a DatasetDict with splits")
    tables = loaded.with_format("arrow").iter(batch_size=batch_rows)
    yield _lines(name, _guarded(tables, path, "the dataset"), batch_rows)


def _pick_split(path: Path, splits: list[str], split: str | None) -> str:
    if split in splits:
        return split
    if split is None and len(splits) == 1:
        return splits[0]
    listed = ", ".join(splits) or "none"
    if split is None:
        raise UsageError(f"{path} has several splits, pick one with --split ({listed})")
    raise UsageError(f"--split {split}: {path} has no such split (it has: {listed})")


def _guarded(batches: Iterable[Any], path: Path, what: str) -> Iterator[Any]:
    """Batches, with pyarrow's errors while reading (a corrupt page) as one usage error."""
    try:
        yield from batches
    except (pa.ArrowException, OSError) as exc:
        raise UsageError(f"cannot read {path} as {what}: {exc}") from exc


def _lines(source: str, batches: Iterable[pa.RecordBatch | pa.Table], batch_rows: int) -> Iterator[SourceLine]:
    row_no = 0
    for batch in batches:
        # A record batch may hold a whole file; convert a slice at a time.
        for offset in range(0, batch.num_rows, batch_rows):
            for record in batch.slice(offset, batch_rows).to_pylist():
                row_no += 1
                yield record_line(source, row_no, record, drop_nulls=True)
