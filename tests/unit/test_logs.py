"""JSON log lines carry the record's coordinates as fields."""

from __future__ import annotations

import logging

import orjson
import pytest

from runtime.logs import configure_logging, record_fields


def test_json_lines_carry_record_fields(capsys: pytest.CaptureFixture[str]) -> None:
    configure_logging("INFO", "json")
    try:
        logging.getLogger("hsx.test").warning("dead-lettering %s", "r-1",
                                              extra=record_fields("r-1", "prompts", 3, 42))
        line = orjson.loads(capsys.readouterr().err.strip().splitlines()[-1])
    finally:
        configure_logging("INFO", "text")
    assert line["message"] == "dead-lettering r-1" and line["level"] == "WARNING"
    assert (line["request_id"], line["topic"], line["partition"], line["offset"]) == ("r-1", "prompts", 3, 42)


def test_missing_fields_are_left_out() -> None:
    assert record_fields(topic="prompts", offset=0) == {"topic": "prompts", "offset": 0}
