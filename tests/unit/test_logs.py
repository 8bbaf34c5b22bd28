"""JSON log lines carry the record's coordinates as fields."""

from __future__ import annotations

import logging

import orjson
import pytest

from hsx.runtime.logs import configure_logging, record_fields, redact, redact_secrets


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


@pytest.mark.parametrize("fmt", ["text", "json"])
def test_configured_secrets_never_reach_a_log_line(fmt: str, capsys: pytest.CaptureFixture[str]) -> None:
    secret = "s3cr3t-" + fmt  # registered for the rest of this process: a value no other test uses
    redact_secrets([secret, ""])
    configure_logging("INFO", fmt)  # type: ignore[arg-type]
    try:
        log = logging.getLogger("hsx.test")
        log.warning("SASL failed for password %s", secret)
        try:
            raise RuntimeError(f"broker said: bad credentials {secret}")
        except RuntimeError:
            log.exception("connecting")
        err = capsys.readouterr().err
    finally:
        configure_logging("INFO", "text")
    assert secret not in err
    assert err.count("***") >= 2 and "bad credentials ***" in err  # the line and the traceback kept, masked


def test_redact_masks_longer_secrets_whole() -> None:
    redact_secrets(["abc-long-secret", "abc"])
    assert redact("x abc-long-secret y abc") == "x *** y ***"
