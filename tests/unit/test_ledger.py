"""hsx run's ledger feed: a record on its topics that no hsx service wrote (topics
shared through HSX_TOPIC_*) is skipped with a warning and counted in the run's
summary, never the end of the run."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import pytest

from hsx.running.ledger import Ledger, LedgerFeed
from hsx.producer.publisher import PublishSummary
from hsx.schemas import DlqHeaders, ErrorClass, Topics
from hsx.summary import RunReport


@dataclass
class FakeMessage:
    """What a consumer returns (the feed's error path is all this test exercises)."""

    _topic: str
    _key: bytes | None
    _value: bytes | None
    _headers: list[tuple[str, bytes]] | None = None

    def error(self) -> None:
        return None

    def topic(self) -> str:
        return self._topic

    def partition(self) -> int:
        return 0

    def offset(self) -> int:
        return 7

    def key(self) -> bytes | None:
        return self._key

    def value(self) -> bytes | None:
        return self._value

    def headers(self) -> list[tuple[str, bytes]] | None:
        return self._headers


def test_records_no_service_wrote_are_skipped_and_the_rest_counted(caplog: pytest.LogCaptureFixture) -> None:
    topics = Topics()
    ledger = Ledger(published={"good", "bad"})
    dead = DlqHeaders.build(ErrorClass.PROMPT_TOO_LONG, "too long", service="extractor").to_kafka()
    messages = [
        FakeMessage(topics.ready, b"x", b'{"not": "a ready event"}'),
        FakeMessage(topics.ready, b"x", None),
        FakeMessage(topics.prompts_dlq, b"\xff\xfe", b"", dead),  # a key that is not UTF-8
        FakeMessage(topics.blocks_dlq, b"bad", b"", [("hsx-error-class", b"no-such-class")]),
        FakeMessage(topics.prompts_dlq, b"good", b"", dead),
    ]
    consumer = type("Consumer", (), {"consume": lambda self, num_messages, timeout: messages,
                                     "close": lambda self: None})()
    feed = LedgerFeed(consumer, topics, ledger)
    with caplog.at_level(logging.WARNING, logger="hsx.running.ledger"):
        feed.poll(0.1)
    assert ledger.foreign == 4
    assert ledger.failed == {"good": ErrorClass.PROMPT_TOO_LONG} and ledger.missing == {"bad"}
    warnings = [r.getMessage() for r in caplog.records if r.name == "hsx.running.ledger"]
    assert len(warnings) == 4 and all("not a record hsx accounts for, skipped" in w for w in warnings)
    assert warnings[0].startswith(f"{topics.ready}[0]@7:")


def test_the_run_summary_counts_foreign_records_only_when_there_are_any(tmp_path: Path) -> None:
    def rows(ledger: Ledger) -> dict[str, str]:
        return dict(RunReport(str(tmp_path), PublishSummary(), ledger, {}, {}, 1.0).rows())

    assert "records not hsx's, skipped" not in rows(Ledger())
    assert rows(Ledger(foreign=3))["records not hsx's, skipped"] == "3"
