"""Every input kind gives the same prompts: the same rows written as JSONL, a
JSON array, Parquet, Arrow (file and stream), Feather and ``datasets``
directories come out as the same events; reading is lazy and ids stable."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.ipc
import pyarrow.parquet as pq
import pytest

from hsx.producer.inputs import InputSpec, open_input, read_input
from hsx.producer.publisher import Mapping, parse_line
from hsx.producer.sources import SourceLine
from hsx.producer.tables import read_parquet
from hsx.runtime.errors import UsageError
from tests.unit.input_files import (
    CHAT_MAPPING, TEXT_MAPPING, WRITERS, Rows, chat_rows, text_rows, write_hf_dataset, write_hf_dataset_dict,
    write_jsonl, write_parquet,
)

SETS = {"texts": (text_rows, TEXT_MAPPING), "chats": (chat_rows, CHAT_MAPPING)}


def events(lines: list[SourceLine], mapping: Mapping, with_ids: bool = True) -> list[dict[str, Any]]:
    """The events the lines map to, as plain dicts (without request ids if asked)."""
    dumped = [parse_line(line, mapping).model_dump(exclude_none=True) for line in lines]
    return dumped if with_ids else [{k: v for k, v in e.items() if k != "request_id"} for e in dumped]


def write(kind: str, rows: Rows, tmp_path: Path) -> Path:
    suffix, writer = WRITERS[kind]
    return writer(rows, tmp_path / f"prompts-{kind}{suffix}")


@pytest.mark.parametrize("kind", list(WRITERS))
@pytest.mark.parametrize("name", list(SETS))
def test_every_kind_gives_the_same_events_as_jsonl(kind: str, name: str, tmp_path: Path) -> None:
    make_rows, mapping = SETS[name]
    rows = make_rows()
    expected = events(list(read_input(InputSpec(str(write_jsonl(rows, tmp_path / "same.jsonl"))))), mapping)
    lines = list(read_input(InputSpec(str(write(kind, rows, tmp_path)))))
    assert [line.line_no for line in lines] == list(range(1, len(rows) + 1))
    assert events(lines, mapping) == expected
    assert expected[0]["request_id"] == rows[0]["uid"] and len(expected) == len(rows)
    # Without --id-field, everything but the generated id is the same too.
    plain = Mapping(mapping.fmt, mapping.text_field, None, mapping.metadata_fields)
    assert events(lines, plain, with_ids=False) == [{k: v for k, v in e.items() if k != "request_id"} for e in expected]


def test_nested_values_come_out_right(tmp_path: Path) -> None:
    chats = list(read_input(InputSpec(str(write("parquet", chat_rows(), tmp_path)))))
    event = parse_line(chats[4], CHAT_MAPPING)
    assert [(m.role, m.content) for m in event.messages or []] == [
        ("system", "Be brief."), ("user", "q4.0"), ("assistant", "a4.0"), ("user", "q4.1"), ("assistant", "a4.1")]
    texts = list(read_input(InputSpec(str(write("json", text_rows(), tmp_path)))))
    assert parse_line(texts[5], TEXT_MAPPING).metadata == {"lang": "fr", "score": 0.625, "tags": ["tag0", "tag1"]}


@pytest.mark.parametrize("kind", list(WRITERS))
def test_generated_ids_are_deterministic_across_reads(kind: str, tmp_path: Path) -> None:
    path = write(kind, text_rows(), tmp_path)
    plain = Mapping(TEXT_MAPPING.fmt, "question")
    first, second = ([parse_line(line, plain).request_id for line in read_input(InputSpec(str(path)))]
                     for _ in range(2))
    assert first == second and len(set(first)) == len(first)
    assert first[2].startswith(f"{path.name}:3:")


def test_columnar_nulls_stand_for_absent_fields(tmp_path: Path) -> None:
    """A table has every column in every row: where a JSONL row leaves a field
    out, the table's row has a null, and it must mean the same."""
    events_rows = [{"request_id": "p", "prompt": "hi"}, {"messages": [{"role": "user", "content": "yo"}]}]
    texts = [{"text": "a", "lang": "en"}, {"text": "b"}]
    text_mapping = Mapping(TEXT_MAPPING.fmt, metadata_fields=("lang",))
    (tmp_path / "events").mkdir()
    (tmp_path / "texts").mkdir()
    for kind in ("parquet", "arrow-file", "hf-dataset"):
        lines = list(read_input(InputSpec(str(write(kind, events_rows, tmp_path / "events")))))
        assert [parse_line(line, Mapping()).kind for line in lines] == ["prompt", "messages"], kind
        assert parse_line(lines[1], Mapping()).request_id.startswith(f"prompts-{kind}")  # generated, not null
        lines = list(read_input(InputSpec(str(write(kind, texts, tmp_path / "texts")))))
        assert [parse_line(line, text_mapping).metadata for line in lines] == [{"lang": "en"}, None], kind


def test_a_dataset_dict_split_by_split(tmp_path: Path) -> None:
    rows = chat_rows()
    path = write_hf_dataset_dict(rows, tmp_path / "chats", train_rows=16)
    train, test = (list(read_input(InputSpec(str(path), split=split))) for split in ("train", "test"))
    assert events(train + test, CHAT_MAPPING) == events(list(read_input(InputSpec(str(write_jsonl(
        rows, tmp_path / "chats.jsonl"))))), CHAT_MAPPING)
    assert (train[0].source, test[0].source, test[0].line_no) == ("chats/train", "chats/test", 1)
    plain = Mapping(CHAT_MAPPING.fmt)
    assert parse_line(test[0], plain).request_id.startswith("chats_test:1:")  # splits do not share ids


def _counting_batches(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Patch ParquetFile.iter_batches to count the batches pulled from it."""
    pulled: list[int] = []
    real = pq.ParquetFile.iter_batches

    def iter_batches(self: pq.ParquetFile, *args: Any, **kwargs: Any) -> Any:
        for batch in real(self, *args, **kwargs):
            pulled.append(batch.num_rows)
            yield batch

    monkeypatch.setattr(pq.ParquetFile, "iter_batches", iter_batches)
    return pulled


def test_parquet_is_read_batch_by_batch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = write_parquet(text_rows(200), tmp_path / "many-groups.parquet", row_group_size=10)
    assert pq.ParquetFile(path).metadata.num_row_groups == 20
    pulled = _counting_batches(monkeypatch)
    with read_parquet(path, batch_rows=10) as lines:
        assert next(lines).line_no == 1
        assert pulled == [10]  # one batch of 200 rows read so far
        assert [line.line_no for line in lines][-1] == 200
    assert pulled == [10] * 20
    pulled.clear()
    with open_input(InputSpec(str(path), limit=3)) as lines:
        assert len(list(lines)) == 3
    assert len(pulled) == 1  # --limit stops reading


@pytest.mark.parametrize("row_group_size", [1000, 100_000])
def test_reading_the_first_row_of_a_large_parquet_file_allocates_little(row_group_size: int, tmp_path: Path) -> None:
    """Neither many row groups (pyarrow would pre-buffer them all) nor one huge
    row group is read whole: Arrow memory stays far below the file's size."""
    blob = "x" * 1000
    table = pa.table({"text": [f"{i}{blob}" for i in range(30_000)]})  # ~30 MB of text
    path = tmp_path / "large.parquet"
    pq.write_table(table, path, row_group_size=row_group_size, compression="none")
    del table
    before = pa.total_allocated_bytes()
    with open_input(InputSpec(str(path))) as lines:
        next(lines)
        assert pa.total_allocated_bytes() - before < 8_000_000


def _damaged(path: Path, found: bytes, replaced: bytes) -> Path:
    data = path.read_bytes()
    assert found in data
    path.write_bytes(data.replace(found, replaced))
    return path


def test_a_columnar_file_pyarrow_cannot_convert_is_one_usage_error(tmp_path: Path) -> None:
    """pyarrow trusts a file's offsets: a batch is validated before its rows
    become Python objects, else an offset past the buffer reads out of bounds (a
    segfault); what it cannot convert (text or a column name not UTF-8, a struct
    with duplicate field names, a date beyond Python's) is a usage error, not
    pyarrow's ValueError or OverflowError."""
    table = pa.table({"prompt": ["abcd", "h\u00e9llo"]})
    arrow = tmp_path / "offsets.arrow"
    with pa.ipc.new_file(arrow, table.schema) as writer:
        writer.write_table(table)
    offsets = np.array([0, 4, 10], np.int32).tobytes()
    _damaged(arrow, offsets, np.array([0, 4, 1 << 25], np.int32).tobytes())
    parquet = tmp_path / "utf8.parquet"
    pq.write_table(table, parquet, compression="none")  # uncompressed, no page checksums: the text as it is
    _damaged(parquet, "h\u00e9llo".encode(), b"h\xff\xfello")
    named = tmp_path / "name.arrow"
    with pa.ipc.new_file(named, table.schema) as writer:
        writer.write_table(table)
    _damaged(named, b"prompt", b"pr\xa0mpt")  # a column name pyarrow decodes only when asked
    turns = pa.StructArray.from_arrays([pa.array(["human"]), pa.array(["hi"])], names=["from", "from"])
    twice = tmp_path / "twice.arrow"  # valid Arrow, but no JSON object holds the struct
    with pa.ipc.new_file(twice, pa.schema([("conversations", turns.type)])) as writer:
        writer.write_table(pa.table({"conversations": turns}))
    dated = tmp_path / "dated.arrow"  # a date32 far beyond Python's datetime.date
    with pa.ipc.new_file(dated, pa.schema([("when", pa.date32())])) as writer:
        writer.write_table(pa.table({"when": pa.array([2**31 - 1], pa.date32())}))
    for path, problem in ((arrow, "offset for slot 2 out of bounds"), (parquet, "Invalid UTF8"),
                          (named, "can't decode byte 0xa0"), (twice, "duplicate field names"),
                          (dated, "must have magnitude")):
        with pytest.raises(UsageError, match=f"cannot read {path} as .*{problem}"):
            list(read_input(InputSpec(str(path))))


@pytest.mark.parametrize("name, content, problem", [
    ("dataset_info.json", b'"not an object"', "AttributeError"),
    ("state.json", b"{}", "KeyError: '_data_files'"),
    ("state.json", b'{"_data_files": [{"filename": 5}]}', "TypeError"),
])
def test_a_damaged_datasets_folder_is_one_usage_error(tmp_path: Path, name: str, content: bytes, problem: str) -> None:
    """datasets reads a folder's JSON files without checking their shape."""
    folder = write_hf_dataset(text_rows(3), tmp_path / "hf")
    (folder / name).write_bytes(content)
    with pytest.raises(UsageError, match=f"cannot read {folder} as a datasets.save_to_disk directory: {problem}"):
        list(read_input(InputSpec(str(folder))))


def test_rows_that_hold_no_data_are_refused_not_read_one_by_one(tmp_path: Path) -> None:
    """A null-typed column holds any number of rows in no bytes: a file of a few
    hundred bytes could declare billions of empty rows, each an invalid line."""
    table = pa.table({"prompt": pa.nulls(2_000_000_000)})
    path = tmp_path / "empty-rows.arrow"
    with pa.ipc.new_file(path, table.schema) as writer:
        writer.write_table(table)
    assert path.stat().st_size < 1000
    with pytest.raises(UsageError, match="a batch of 2000000000 rows without data .columns: prompt, none holding"):
        next(read_input(InputSpec(str(path))))
