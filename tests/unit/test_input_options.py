"""The input options (``--limit``, ``--shuffle --seed``, ``--split``,
``--input-format``), one clear error per bad input, the shared argument group,
and the Publisher's ``skip_ids`` / ``on_sent``."""

from __future__ import annotations

import argparse
import io
import sys
from pathlib import Path
from typing import Any

import orjson
import pytest

from hsx.producer.cli import add_input_arguments, input_from_args
from hsx.producer.inputs import InputKind, InputRows, InputSpec, detect_kind, open_input, read_input, shuffled
from hsx.producer.publisher import Mapping, Publisher
from hsx.producer.sources import DatasetFormat, SourceLine
from hsx.runtime.errors import UsageError
from hsx.schemas import PromptEvent, Topics
from tests.fuzz.target import REGRESSIONS as FUZZ_FINDINGS
from tests.unit.input_files import text_rows, write_hf_dataset, write_hf_dataset_dict, write_jsonl, write_parquet


def numbers(spec: InputSpec) -> list[int]:
    return [line.line_no for line in read_input(spec)]


@pytest.fixture
def parquet(tmp_path: Path) -> Path:
    return write_parquet(text_rows(40), tmp_path / "rows.parquet")


def test_limit_takes_the_first_rows(parquet: Path) -> None:
    assert numbers(InputSpec(str(parquet), limit=5)) == [1, 2, 3, 4, 5]
    assert numbers(InputSpec(str(parquet), limit=0)) == []
    assert len(numbers(InputSpec(str(parquet), limit=1000))) == 40


def test_shuffle_is_seeded_and_keeps_rows_and_ids(parquet: Path) -> None:
    plain = numbers(InputSpec(str(parquet)))
    once, again, other = (numbers(InputSpec(str(parquet), shuffle=True, seed=seed)) for seed in (1, 1, 2))
    assert once == again and once != other and once != plain
    assert sorted(once) == sorted(other) == plain
    # A row keeps its number, and so its generated id, wherever it lands.
    by_no = {line.line_no: line for line in read_input(InputSpec(str(parquet)))}
    assert all(by_no[line.line_no] == line for line in read_input(InputSpec(str(parquet), shuffle=True, seed=1)))
    # --limit applies after the shuffle.
    assert numbers(InputSpec(str(parquet), shuffle=True, seed=1, limit=3)) == once[:3]


def test_a_shuffle_larger_than_its_buffer_stays_a_seeded_permutation() -> None:
    lines = [SourceLine("f", i, b"{}") for i in range(1, 101)]
    first, second = (list(shuffled(iter(lines), seed=7, buffer_rows=10)) for _ in range(2))
    assert first == second and first != lines and sorted(first, key=lambda l: l.line_no) == lines


def test_split_picks_one_split_of_a_dataset_dict(tmp_path: Path) -> None:
    path = write_hf_dataset_dict(text_rows(12), tmp_path / "dd", train_rows=8)
    assert len(numbers(InputSpec(str(path), split="train"))) == 8
    assert len(numbers(InputSpec(str(path), split="test"))) == 4
    with pytest.raises(UsageError, match=r"several splits, pick one with --split \(train, test\)"):
        numbers(InputSpec(str(path)))
    with pytest.raises(UsageError, match=r"--split dev: .* no such split \(it has: train, test\)"):
        numbers(InputSpec(str(path), split="dev"))
    single = write_hf_dataset(text_rows(3), tmp_path / "single")
    with pytest.raises(UsageError, match="single Dataset, not a DatasetDict"):
        numbers(InputSpec(str(single), split="train"))


def test_a_dataset_folder_cannot_name_files_outside_it(tmp_path: Path) -> None:
    outside = write_hf_dataset(text_rows(3), tmp_path / "outside")
    arrow = next(outside.glob("*.arrow"))
    single = write_hf_dataset(text_rows(2), tmp_path / "single")
    state = orjson.loads((single / "state.json").read_bytes())
    state["_data_files"] = [{"filename": f"../outside/{arrow.name}"}]
    (single / "state.json").write_bytes(orjson.dumps(state))
    with pytest.raises(UsageError, match=r"state.json names data file '\.\./outside/.*', not a file name inside"):
        numbers(InputSpec(str(single)))
    splits = write_hf_dataset_dict(text_rows(4), tmp_path / "dd", train_rows=2)
    (splits / "dataset_dict.json").write_bytes(orjson.dumps({"splits": ["train", "../outside"]}))
    with pytest.raises(UsageError, match=r"dataset_dict.json names split '\.\./outside', not a folder name"):
        numbers(InputSpec(str(splits), split="train"))


@pytest.mark.parametrize(
    "path, kind",
    [("a.jsonl", InputKind.JSONL), ("a.NDJSON", InputKind.JSONL), ("a.json", InputKind.JSON),
     ("a.parquet", InputKind.PARQUET), ("a.arrow", InputKind.ARROW), ("a.feather", InputKind.ARROW),
     ("a.ipc", InputKind.ARROW)],
)
def test_kinds_come_from_the_extension(path: str, kind: InputKind, tmp_path: Path) -> None:
    (tmp_path / path).write_bytes(b"")
    assert detect_kind(str(tmp_path / path)) is kind
    assert detect_kind(str(tmp_path / path), InputKind.JSONL) is InputKind.JSONL  # --input-format wins
    assert detect_kind("-") is InputKind.JSONL


def test_input_format_overrides_the_extension(tmp_path: Path) -> None:
    path = write_jsonl(text_rows(3), tmp_path / "rows.txt")
    assert numbers(InputSpec(str(path), kind=InputKind.JSONL)) == [1, 2, 3]


def _bad_inputs(tmp: Path) -> list[tuple[InputSpec, str]]:
    (tmp / "notes.txt").write_text("x")
    (tmp / "fake.parquet").write_text("not parquet")
    (tmp / "fake.arrow").write_text("not arrow")
    (tmp / "object.json").write_bytes(b'{"conversations": []}')
    (tmp / "empty.json").write_bytes(b"")
    (tmp / "plain-dir").mkdir()
    (tmp / "narrow.arrow").write_bytes((FUZZ_FINDINGS / "input_arrow/integer-type-under-8-bits-not-implemented").read_bytes())
    write_jsonl(text_rows(2), tmp / "rows.jsonl")
    return [
        (InputSpec(str(tmp / "nope.parquet")), "cannot read .*nope.parquet: No such file or directory"),
        (InputSpec(str(tmp / "notes.txt")), r"unknown extension '.txt' .* --input-format"),
        (InputSpec(str(tmp / "fake.parquet")), "cannot read .*fake.parquet as Parquet: "),
        (InputSpec(str(tmp / "fake.arrow")), r"cannot read .*fake.arrow as Arrow IPC \(file or stream format\)"),
        (InputSpec(str(tmp / "narrow.arrow")), r"cannot read .*narrow.arrow as Arrow IPC .*less than 8 bits"),
        (InputSpec(str(tmp / "object.json")), "must be one JSON array of rows, found a JSON object.*jsonl"),
        (InputSpec(str(tmp / "empty.json")), "empty.json: not valid JSON"),
        (InputSpec(str(tmp / "plain-dir")), "not one written by datasets.save_to_disk"),
        (InputSpec(str(tmp / "plain-dir"), kind=InputKind.PARQUET), "is a directory"),
        (InputSpec(str(tmp / "rows.jsonl"), kind=InputKind.HF_DISK), "is a file, not a datasets.save_to_disk"),
        (InputSpec(str(tmp / "rows.jsonl"), split="train"), "only a datasets.save_to_disk directory has splits"),
        (InputSpec("-", kind=InputKind.PARQUET), "needs a file, not standard input"),
    ]


def test_a_json_row_that_is_not_utf8_is_a_usage_error_naming_the_row(tmp_path: Path) -> None:
    path = tmp_path / "rows.json"
    path.write_bytes(b'[{"prompt": "fine"}, {"prompt": "Question 0:\xe0\x88\x97"}]')
    rows = read_input(InputSpec(str(path)))
    with pytest.raises(UsageError, match=r"rows.json: not valid JSON after row 1: .*utf-8"):
        list(rows)


def test_bad_inputs_are_one_clear_usage_error_on_opening(tmp_path: Path) -> None:
    for spec, message in _bad_inputs(tmp_path):
        with pytest.raises(UsageError, match=message):
            with open_input(spec):
                pytest.fail(f"{spec} opened")
        with pytest.raises(UsageError, match=message):
            InputRows(spec)


def test_broken_json_mid_array_says_where(tmp_path: Path) -> None:
    path = tmp_path / "cut.json"
    path.write_bytes(orjson.dumps(text_rows(5))[:-40])
    with open_input(InputSpec(str(path))) as lines:
        with pytest.raises(UsageError, match="cut.json: not valid JSON after row 4"):
            list(lines)


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_input_arguments(parser)
    return parser.parse_args(list(argv))


def test_the_shared_input_flags(tmp_path: Path) -> None:
    saved = str(write_hf_dataset_dict(text_rows(12), tmp_path / "dd", train_rows=8))
    lines, mapping, on_invalid = input_from_args(parse(
        saved, "--input-format", "hf-disk", "--split", "test", "--limit", "3", "--shuffle", "--seed", "3",
        "--format", "text", "--text-field", "q", "--id-field", "uid", "--metadata-fields", "a,b", "--on-invalid", "dlq"))
    assert lines.spec == InputSpec(saved, InputKind.HF_DISK, "test", 3, True, 3)
    assert (mapping, on_invalid) == (Mapping(DatasetFormat.TEXT, "q", "uid", ("a", "b")), "dlq")
    assert len(list(lines)) == 3 and list(lines) == list(lines)  # read afresh on each iteration
    rows = str(write_jsonl(text_rows(2), tmp_path / "x.jsonl"))
    defaults = input_from_args(parse(rows))
    assert defaults.lines.spec == InputSpec(rows) and defaults.mapping == Mapping()
    with pytest.raises(UsageError, match="--seed only makes sense with --shuffle"):
        input_from_args(parse(rows, "--seed", "1"))
    with pytest.raises(UsageError, match="--split train: only a datasets.save_to_disk"):
        input_from_args(parse(rows, "--split", "train"))  # checked when parsed, before anything starts
    with pytest.raises(SystemExit):
        parse(rows, "--limit", "-1")


class FakeTracker:
    """Records what the Publisher queues (no broker)."""

    def __init__(self) -> None:
        self.producer: Any = None
        self.sent: list[bytes] = []

    def produce(self, topic: str, value: bytes, key: bytes | None = None, headers: Any = None) -> None:
        self.sent.append(key or b"")

    def flush(self, timeout: float = 60.0) -> None:
        pass


def test_publisher_skips_given_ids_and_reports_each_sent_event(tmp_path: Path) -> None:
    path = write_jsonl(text_rows(6), tmp_path / "rows.jsonl")
    tracker = FakeTracker()
    publisher = Publisher(tracker, Topics(), Mapping(DatasetFormat.TEXT, "question", "uid"))  # type: ignore[arg-type]
    seen: list[PromptEvent] = []
    summary = publisher.publish(read_input(InputSpec(str(path))), skip_ids={"t-1", "t-4", "other"}, on_sent=seen.append)
    assert tracker.sent == [b"t-0", b"t-2", b"t-3", b"t-5"] == [e.request_id.encode() for e in seen]
    assert (summary.sent, summary.skipped, summary.invalid) == (4, 2, 0)
    assert "skipped 2 already present" in summary.describe()
    assert "skipped" not in publisher.publish(read_input(InputSpec(str(path)))).describe()


def test_without_datasets_installed_a_dataset_directory_says_what_to_install(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = write_hf_dataset(text_rows(2), tmp_path / "saved")
    monkeypatch.setitem(sys.modules, "datasets", None)  # makes `import datasets` raise ImportError
    with pytest.raises(UsageError, match=r"needs the datasets package: pip install 'hsx\[datasets\]'"):
        numbers(InputSpec(str(path)))


def test_standard_input_as_jsonl_or_json(monkeypatch: pytest.MonkeyPatch) -> None:
    for kind, data in ((None, b'{"prompt": "a"}\n{"prompt": "b"}\n'), (InputKind.JSON, b'[{"prompt": "a"}, {"prompt": "b"}]')):
        monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(data)))
        lines = list(InputRows(InputSpec("-", kind)))
        assert [(line.source, line.line_no, orjson.loads(line.raw)) for line in lines] == [
            ("stdin", 1, {"prompt": "a"}), ("stdin", 2, {"prompt": "b"})]


def test_generate_attaches_generation_to_rows_without_one(tmp_path: Path) -> None:
    from hsx.producer.publisher import parse_line

    path = tmp_path / "gen.jsonl"
    path.write_bytes(b'{"prompt": "hi"}\n{"prompt": "yo", "generation": {"max_tokens": 3}}\n')
    args = parse(str(path), "--generate", "max_tokens=512,temperature=0.7,seed=1,stop_token_ids=[2,7]",
                 "--turns", "last")
    prompt_input = input_from_args(args)
    first, second = (parse_line(line, prompt_input.mapping) for line in prompt_input.lines)
    assert first.generation is not None and first.generation.model_dump(exclude_none=True) == {
        "max_tokens": 512, "temperature": 0.7, "seed": 1, "stop_token_ids": [2, 7], "ignore_eos": False,
        "turns": "last"}
    assert second.generation is not None and second.generation.max_tokens == 3  # the row's own wins


@pytest.mark.parametrize("flag, value, phrase", [
    ("--generate", "max_tokens=0", "max_tokens"), ("--generate", "max_tokens=5,beam=2", "beam"),
    ("--generate", "temperature", "KEY=VALUE"), ("--chat-template-kwargs", "{bad", "not JSON"),
    ("--chat-template-kwargs", '{"messages": []}', "may not set 'messages'"),
    ("--chat-template-kwargs", "[1]", "dict_type")])
def test_bad_flag_values_name_the_rule(flag: str, value: str, phrase: str, tmp_path: Path,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        parse(str(tmp_path / "x.jsonl"), flag, value)
    assert exit_.value.code == 2 and phrase in capsys.readouterr().err


def test_turns_needs_generate(tmp_path: Path) -> None:
    path = tmp_path / "x.jsonl"
    path.write_bytes(b'{"prompt": "hi"}\n')
    with pytest.raises(UsageError, match="--turns only makes sense with --generate"):
        input_from_args(parse(str(path), "--turns", "all"))


def test_chat_template_kwargs_attach_to_chats_without_their_own(tmp_path: Path) -> None:
    from hsx.producer.publisher import parse_line

    path = tmp_path / "chats.jsonl"
    chat = '"messages": [{"role": "user", "content": "hi"}]'
    path.write_text(f'{{{chat}}}\n{{{chat}, "chat_template_kwargs": {{"enable_thinking": true}}}}\n{{"prompt": "hi"}}\n')
    prompt_input = input_from_args(parse(str(path), "--chat-template-kwargs", '{"enable_thinking": false}'))
    first, second, text = (parse_line(line, prompt_input.mapping) for line in prompt_input.lines)
    assert first.chat_template_kwargs == {"enable_thinking": False}
    assert second.chat_template_kwargs == {"enable_thinking": True}  # the row's own wins
    assert text.chat_template_kwargs is None  # a text prompt has no template
