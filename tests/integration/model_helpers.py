"""Helpers shared by the model test modules (test_built_models, test_model_cache)."""

from __future__ import annotations

from pathlib import Path

from hsx import models


def marker(path: Path) -> Path:
    return path / models.MARKER_FILE
