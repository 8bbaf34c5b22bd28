"""Input mapping: dataset shapes onto prompt events, and deterministic ids."""

from __future__ import annotations

import io

import orjson
import pytest

from hsx.producer.publisher import InvalidLine, Mapping, parse_line
from hsx.producer.sources import DatasetFormat, SourceLine, generated_request_id, read_jsonl


def line(obj: object, no: int = 1, source: str = "data.jsonl") -> SourceLine:
    return SourceLine(source, no, orjson.dumps(obj))


def test_read_jsonl_skips_blank_lines_and_numbers_from_one() -> None:
    lines = list(read_jsonl(io.BytesIO(b'{"a":1}\n\n  \n{"b":2}\r\n'), "f.jsonl"))
    assert [(l.line_no, l.raw) for l in lines] == [(1, b'{"a":1}'), (4, b'{"b":2}')]


def test_generated_ids_are_deterministic_and_safe() -> None:
    a = line({"prompt": "hi"}, 3, "my data (v2)/../x.jsonl")
    rid = generated_request_id(a)
    assert rid == generated_request_id(SourceLine(a.source, 3, a.raw))
    assert rid.startswith("my_data_v2_") and "/" not in rid and ".." not in rid
    assert parse_line(a, Mapping()).request_id == rid  # and it passes the contract
    others = {generated_request_id(line({"prompt": "hi"}, 4)), generated_request_id(line({"prompt": "ho"}, 3))}
    assert rid not in others and len(others) == 2


def test_event_format_keeps_given_id() -> None:
    event = parse_line(line({"request_id": "abc", "token_ids": [1, 2]}), Mapping())
    assert (event.request_id, event.token_ids) == ("abc", [1, 2])


def test_text_format_with_id_and_metadata_fields() -> None:
    mapping = Mapping(DatasetFormat.TEXT, text_field="question", id_field="uid", metadata_fields=("split", "absent"))
    event = parse_line(line({"uid": "q-7", "question": "Why?", "split": "dev", "other": 1}), mapping)
    assert (event.request_id, event.prompt, event.metadata) == ("q-7", "Why?", {"split": "dev"})


def test_sharegpt_format_maps_speakers() -> None:
    record = {"conversations": [{"from": "system", "value": "Be brief."}, {"from": "human", "value": "Hi"},
                                {"from": "gpt", "value": "Hello"}, {"from": "function", "value": "{}"}]}
    event = parse_line(line(record), Mapping(DatasetFormat.SHAREGPT))
    assert [(m.role, m.content) for m in event.messages or []] == [
        ("system", "Be brief."), ("user", "Hi"), ("assistant", "Hello"), ("tool", "{}")]


def test_openai_format() -> None:
    record = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"}]}
    assert parse_line(line(record), Mapping(DatasetFormat.OPENAI)).kind == "messages"


@pytest.mark.parametrize(
    "raw, mapping, error_class, fragment",
    [
        (b"{not json", Mapping(), "invalid_json", "not valid JSON"),
        (b"[1, 2]", Mapping(), "invalid_shape", "JSON list"),
        (orjson.dumps({"body": "x"}), Mapping(DatasetFormat.TEXT), "invalid_shape", "missing text field 'text'"),
        (orjson.dumps({"text": "x"}), Mapping(DatasetFormat.TEXT, id_field="id"), "invalid_shape", "missing id field 'id'"),
        (orjson.dumps({"conversations": [{"from": "alien", "value": "x"}]}), Mapping(DatasetFormat.SHAREGPT),
         "invalid_shape", "unknown speaker 'alien'"),
        (orjson.dumps({"conversations": "x"}), Mapping(DatasetFormat.SHAREGPT), "invalid_shape", "conversations"),
        (orjson.dumps({"messages": [{"role": "bot", "content": "x"}]}), Mapping(DatasetFormat.OPENAI),
         "invalid_event", "messages.0.role"),
        (orjson.dumps({"text": ""}), Mapping(DatasetFormat.TEXT), "invalid_event", "prompt: "),
    ],
)
def test_invalid_lines_say_why(raw: bytes, mapping: Mapping, error_class: str, fragment: str) -> None:
    with pytest.raises(InvalidLine) as info:
        parse_line(SourceLine("f.jsonl", 9, raw), mapping)
    assert info.value.error_class == error_class
    assert fragment in str(info.value) and str(info.value).startswith("f.jsonl:9: ")
