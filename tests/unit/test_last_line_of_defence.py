"""The last line of defence (#35): an exception no rule names, raised while one
record is parsed or checked, dead-letters that record as ``unexpected`` and the
service goes on. Mocks stand in for the engine and Kafka: this is an error path
no valid or known-invalid record reaches (the fuzz targets look for real ones)."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest

from hsx.extractor.service import Extractor
from hsx.runtime.errors import InvalidInput
from hsx.schemas import DEFAULT_LIMITS


class _Message:
    def __init__(self, value: bytes) -> None:
        self._value = value

    def topic(self) -> str:
        return "prompts"

    def partition(self) -> int:
        return 0

    def offset(self) -> int:
        return 41

    def value(self) -> bytes:
        return self._value

    def key(self) -> bytes:
        return b"r-1"


class _Preparer:
    def prepare(self, event: Any) -> None:
        raise IndexError("a defect in the chat template code")


def test_an_unexpected_error_preparing_a_prompt_dead_letters_it(caplog: pytest.LogCaptureFixture) -> None:
    extractor = Extractor.__new__(Extractor)
    extractor.limits = DEFAULT_LIMITS
    extractor._preparer = _Preparer()  # type: ignore[assignment]
    letters: list[tuple[bytes, InvalidInput]] = []
    extractor._dead_letter = lambda message, rejection: letters.append((message.value(), rejection))  # type: ignore[method-assign]

    value = b'{"request_id": "r-1", "prompt": "hi"}'
    with caplog.at_level(logging.ERROR):
        asyncio.run(extractor._process(_Message(value)))  # type: ignore[arg-type]

    ((dead, rejection),) = letters
    assert dead == value and rejection.error_class == "unexpected"
    assert rejection.reason == "unexpected IndexError while checking the record: a defect in the chat template code"
    (logged,) = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert "prompts-0@41" in logged.getMessage() and logged.exc_info is not None  # the traceback, for the report
