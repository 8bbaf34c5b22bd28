"""Shared fixtures: one real Kafka-protocol broker per test session (found in the
order design.md fixes) and fresh topic names per test so tests never see each
other's records."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest

from hsx.dev.topics import fresh_topic_settings
from runtime.broker import dev_bootstrap
from runtime.settings import KafkaSettings, TopicSettings


@pytest.fixture(scope="session")
def kafka_bootstrap() -> Iterator[str]:
    """``HSX_KAFKA_BOOTSTRAP``, else a Kafka container when Docker answers, else the
    embedded broker."""
    with dev_bootstrap() as bootstrap:
        yield bootstrap


@pytest.fixture
def kafka(kafka_bootstrap: str) -> KafkaSettings:
    return KafkaSettings(bootstrap=kafka_bootstrap)


@pytest.fixture
def restore_root_logging() -> Iterator[None]:
    """Tests that call ``hsx.cli.main`` in-process: it configures the root logger
    for the process, which is undone after the test."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


@pytest.fixture
def topic_settings() -> TopicSettings:
    """Topic names unique to this test, two partitions each."""
    return fresh_topic_settings(partitions=2)
