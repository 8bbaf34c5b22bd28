"""A small prompt set (text rows and ShareGPT chats, with metadata) and writers
that store it in every input kind ``hsx produce`` reads."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import orjson
import pyarrow as pa
import pyarrow.feather
import pyarrow.ipc
import pyarrow.parquet as pq

from hsx.producer.publisher import Mapping
from hsx.producer.sources import DatasetFormat

if TYPE_CHECKING:  # imported lazily at run time: an optional extra
    import datasets

Rows = list[dict]

TEXT_MAPPING = Mapping(DatasetFormat.TEXT, text_field="question", id_field="uid", metadata_fields=("lang", "score", "tags"))
CHAT_MAPPING = Mapping(DatasetFormat.SHAREGPT, id_field="uid", metadata_fields=("lang", "score"))


def text_rows(n: int = 30) -> Rows:
    """Text prompts; metadata with floats and a nested list."""
    return [{"uid": f"t-{i}", "question": f"Question {i}: why ✓?", "lang": ["en", "fr"][i % 2],
             "score": i / 8, "tags": [f"tag{j}" for j in range(i % 3)]} for i in range(n)]


def chat_rows(n: int = 24) -> Rows:
    """ShareGPT conversations of different lengths (a list of structs per row)."""
    rows = []
    for i in range(n):
        turns = [{"from": "system", "value": "Be brief."}] if i % 4 == 0 else []
        for t in range(1 + i % 3):
            turns += [{"from": "human", "value": f"q{i}.{t}"}, {"from": "gpt", "value": f"a{i}.{t}"}]
        rows.append({"uid": f"c-{i}", "conversations": turns, "lang": "en", "score": 1.5 + i})
    return rows


def table_of(rows: Rows) -> pa.Table:
    """The rows as a table with every field any row has (``from_pylist`` takes
    the fields of the first row only); absent fields become nulls."""
    fields = dict.fromkeys(key for row in rows for key in row)
    return pa.Table.from_pydict({key: [row.get(key) for row in rows] for key in fields})


def write_jsonl(rows: Rows, path: Path) -> Path:
    path.write_bytes(b"".join(orjson.dumps(row) + b"\n" for row in rows))
    return path


def write_json(rows: Rows, path: Path) -> Path:
    path.write_bytes(orjson.dumps(rows, option=orjson.OPT_INDENT_2))
    return path


def write_parquet(rows: Rows, path: Path, row_group_size: int = 7) -> Path:
    pq.write_table(table_of(rows), path, row_group_size=row_group_size)
    return path


def write_arrow_file(rows: Rows, path: Path) -> Path:
    table = table_of(rows)
    with pa.ipc.new_file(path, table.schema) as writer:
        for batch in table.to_batches(max_chunksize=5):
            writer.write_batch(batch)
    return path


def write_arrow_stream(rows: Rows, path: Path) -> Path:
    """The stream format, as in the ``.arrow`` files of a ``datasets`` cache."""
    table = table_of(rows)
    with pa.ipc.new_stream(path, table.schema) as writer:
        writer.write_table(table, max_chunksize=9)
    return path


def write_feather(rows: Rows, path: Path) -> Path:
    pa.feather.write_feather(table_of(rows), path, chunksize=8)  # lz4-compressed by default
    return path


def write_hf_dataset(rows: Rows, path: Path) -> Path:
    _hf_dataset(rows).save_to_disk(str(path))
    return path


def write_hf_dataset_dict(rows: Rows, path: Path, train_rows: int) -> Path:
    """Two splits: ``train`` (the first ``train_rows``) and ``test`` (the rest)."""
    import datasets

    datasets.DatasetDict({"train": _hf_dataset(rows[:train_rows]),
                          "test": _hf_dataset(rows[train_rows:])}).save_to_disk(str(path))
    return path


def _hf_dataset(rows: Rows) -> datasets.Dataset:
    import datasets

    return datasets.Dataset.from_dict(table_of(rows).to_pydict())  # from_list also takes the first row's fields


WRITERS: dict[str, tuple[str, Callable[[Rows, Path], Path]]] = {
    "jsonl": (".jsonl", write_jsonl),
    "json": (".json", write_json),
    "parquet": (".parquet", write_parquet),
    "arrow-file": (".arrow", write_arrow_file),
    "arrow-stream": (".arrow", write_arrow_stream),
    "feather": (".feather", write_feather),
    "hf-dataset": ("", write_hf_dataset),
}
"""Kind name → (file suffix, writer)."""
