"""Every command maps an HsxError to one log line and the exit-code table (the
commands configure logging themselves, so their stderr is what a user sees)."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest

from hsx import models
from hsx.cli import main
from runtime.errors import ExitCode

pytestmark = pytest.mark.integration


@pytest.fixture(autouse=True)
def _restore_logging() -> Iterator[None]:
    """``main`` configures the root logger for the process: undo it for later tests."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


def test_layer_ids_the_model_lacks_are_a_usage_error(capfd: pytest.CaptureFixture[str]) -> None:
    tiny = models.prepare(names=["tiny-llama"])["tiny-llama"]
    status = main(["extract", "--model", str(tiny), "--layers", "1,99", "--bootstrap", "127.0.0.1:1"])
    err = capfd.readouterr().err
    assert status == ExitCode.USAGE == 2
    assert "hsx extract: layer ids go up to num_hidden_layers = 4, got [1, 99]" in err


def test_an_unreadable_input_file_is_a_usage_error(kafka_bootstrap: str, capfd: pytest.CaptureFixture[str]) -> None:
    status = main(["produce", "/nonexistent.jsonl", "--bootstrap", kafka_bootstrap, "--no-progress"])
    err = capfd.readouterr().err
    assert status == ExitCode.USAGE
    assert "cannot read /nonexistent.jsonl: No such file or directory" in err
    assert "Traceback" not in err
