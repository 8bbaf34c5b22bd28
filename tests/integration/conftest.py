"""Session fixtures of the model tests: the real models, built once into one cache."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from hsx import models


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """$HSX_CACHE_DIR (the Makefile sets it, so a prepared cache is reused) or a temporary directory."""
    configured = os.environ.get(models.CACHE_DIR_ENV)
    return Path(configured) if configured else tmp_path_factory.mktemp("hsx-cache")


@pytest.fixture(scope="session")
def prepared(cache_dir: Path) -> dict[str, Path]:
    """The real models, built once per session. vLLM is deliberately not started by the
    model tests: engine start takes minutes on CPU; the engine tests load these same directories."""
    return models.prepare(cache_dir)
