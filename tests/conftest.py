"""Shared fixtures: one real Kafka-protocol broker per test session (found in the
order design.md fixes) and fresh topic names per test so tests never see each
other's records; likewise one S3 service per session (``HSX_TEST_S3_ENDPOINT``,
else a local SeaweedFS server) and a fresh dataset prefix per test."""

from __future__ import annotations

import logging
import os
import re
import uuid
from collections.abc import Iterator

import pytest

from hsx.local.broker import dev_bootstrap
from hsx.local.s3server import dev_s3
from hsx.local.s3service import AWS_ENV_OVERRIDDEN, S3Service
from hsx.local.topics import fresh_topic_settings
from hsx.runtime.settings import KafkaSettings, TopicSettings


ENGINE_GROUPS = ("engine", "faults")


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads the groups
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """``make test`` runs three pytest-xdist workers with ``--dist loadgroup``. The
    engine tests form two groups, so two workers run them one at a time each
    (``engine``: the in-process engines and their session fixtures, as a single
    process would share them; ``faults``: the modules marked ``faults``, whose
    engines run as hsx services and whose time is mostly waiting out what they
    inject), at most two engines at once on the machine, while the third runs
    everything else, which mostly waits on brokers, sinks and S3."""
    for item in items:
        if item.get_closest_marker("engine"):
            item.add_marker(pytest.mark.xdist_group("faults" if item.get_closest_marker("faults") else "engine"))


def pytest_runtest_setup(item: pytest.Item) -> None:
    """On an xdist worker of a ``--dist loadgroup`` run, xdist marks grouped tests
    by a suffix of their node ids; without it (pytest-dev/pytest-xdist#1386) the
    engine tests would spread over every worker, silently: each of them fails instead."""
    grouped = (not getattr(item.config.option, "loadgroup", False)
               or item.nodeid.endswith(tuple(f"@{group}" for group in ENGINE_GROUPS)))
    if item.get_closest_marker("engine") and not grouped:
        pytest.fail("pytest-xdist did not group the engine tests: this pytest and pytest-xdist do not work "
                    "together (pytest-dev/pytest-xdist#1386); see pyproject.toml", pytrace=False)


@pytest.fixture(scope="session")
def kafka_bootstrap() -> Iterator[str]:
    """``HSX_KAFKA_BOOTSTRAP``, else a Kafka container when Docker answers, else the
    embedded broker."""
    with dev_bootstrap() as bootstrap:
        yield bootstrap


@pytest.fixture
def kafka(kafka_bootstrap: str) -> KafkaSettings:
    return KafkaSettings(bootstrap=kafka_bootstrap)


@pytest.fixture(autouse=True)
def restore_root_logging() -> Iterator[None]:
    """``hsx.cli.main`` called in-process configures the root logger with a
    handler on the stderr of that moment, which pytest closes after the test:
    undone after every test, so that no later test's log line meets a closed
    stream ("--- Logging error ---" on its stderr)."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


@pytest.fixture
def topic_settings() -> TopicSettings:
    """Topic names unique to this test, two partitions each."""
    return fresh_topic_settings(partitions=2)


TEST_BUCKET_ENV = "HSX_TEST_S3_BUCKET"


@pytest.fixture(scope="session")
def s3_server() -> Iterator[S3Service]:
    """The S3 service of this session: ``HSX_TEST_S3_ENDPOINT`` (keys from
    ``HSX_TEST_S3_ACCESS_KEY_ID`` / ``HSX_TEST_S3_SECRET_ACCESS_KEY``, else
    ``AWS_*``), else a local SeaweedFS server started on first use (about 3 s).
    ``s3_server.can_pause`` says whether outage tests can ``pause()`` it."""
    with dev_s3() as service:
        yield service


@pytest.fixture(scope="session")
def s3_bucket(s3_server: S3Service) -> str:
    """The session's bucket (``HSX_TEST_S3_BUCKET``, default ``hsx-test``), created
    when missing. Tests share it and keep apart by prefix (``s3_dataset_url``)."""
    bucket = os.environ.get(TEST_BUCKET_ENV) or "hsx-test"
    s3_server.create_bucket(bucket, exist_ok=True)
    return bucket


@pytest.fixture
def s3_env(s3_server: S3Service, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """The ``AWS_*`` environment of this test points at ``s3_server`` (for product
    code and child processes that read it); credentials of the caller's shell that
    would interfere (session token, profile) are removed. Undone after the test."""
    for name in AWS_ENV_OVERRIDDEN:
        monkeypatch.delenv(name, raising=False)
    env = s3_server.environ()
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    return env


@pytest.fixture
def s3_dataset_url(request: pytest.FixtureRequest, s3_bucket: str, s3_env: dict[str, str]) -> str:
    """``s3://<bucket>/<test name>-<random>``: a prefix no other test or run uses,
    with the test's ``AWS_*`` environment set (``s3_env``) so it opens as is."""
    name = re.sub(r"[^a-z0-9_-]+", "-", request.node.name.lower()).strip("-")[:48]
    return f"s3://{s3_bucket}/{name}-{uuid.uuid4().hex[:8]}"
