"""What the extractor reads from a model's Hugging Face config, before any engine
exists (the engine, the CPU defaults and the command line all need it), and the
sizes it implies: weights and KV cache per token."""

from __future__ import annotations

from typing import Any


def hf_config(model: str) -> Any:
    """The model's config as transformers' ``AutoConfig`` reads it."""
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(model)


def text_config(model: str) -> Any:
    """The model's text config (``num_hidden_layers``, ``hidden_size``,
    ``vocab_size``), also for multimodal configs that nest it."""
    return text_part(hf_config(model))


def text_part(config: Any) -> Any:
    """``config``'s text config: the nested one of a multimodal model, else itself."""
    return getattr(config, "get_text_config", lambda: config)()


def vision_language_blocker(config: Any) -> str | None:
    """Why vLLM cannot load the model of ``config`` (from :func:`hf_config`)
    here, for a vision-language model (a config with a ``vision_config``):
    vLLM's vision-language models import torchvision (even to run text), and it
    does not import. None for any other model, or where torchvision imports."""
    problem = torchvision_problem() if hasattr(config, "vision_config") else None
    if problem is None:
        return None
    architecture = ", ".join(getattr(config, "architectures", None) or [config.model_type])
    return (f"{architecture} is a vision-language model: the engine needs torchvision to load one, and it does "
            f"not import here ({problem}); install the torchvision built for this torch")


def torchvision_problem() -> str | None:
    """Why ``import torchvision`` fails, or None when it works."""
    import importlib

    try:
        importlib.import_module("torchvision")
    except Exception as exc:  # missing, or built for another torch (RuntimeError: operator ... does not exist)
        return f"{type(exc).__name__}: {exc}"
    return None


_DTYPE_BYTES = {"float32": 4, "float": 4, "float16": 2, "half": 2, "bfloat16": 2}


def dtype_bytes(dtype: str) -> int:
    """Bytes per element of the model's (and cache's) dtype; ``auto`` and anything
    unknown count as float32, the most vLLM's CPU backend uses."""
    return _DTYPE_BYTES.get(str(dtype).removeprefix("torch."), 4)


def _attention_shape(config: Any) -> tuple[int, int, int]:
    """Query heads, key/value heads and head size of a text config."""
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return heads, getattr(config, "num_key_value_heads", None) or heads, head_dim


def kv_bytes_per_token(config: Any, element_bytes: int, num_hidden_states: int) -> int:
    """vLLM's cache per token: keys and values of every attention layer, plus the
    ``extract_hidden_states`` draft's cache-only layer holding ``num_hidden_states``
    vectors of ``hidden_size``. Its ``HiddenStateCacheSpec`` is a full-attention spec,
    so it shares the attention layers' blocks (vLLM's "CPU KV cache size" log line
    agrees: 38,784 tokens in 2 GiB for SmolLM2 with 4 layers extracted)."""
    _, kv_heads, head_dim = _attention_shape(config)
    attention = config.num_hidden_layers * 2 * kv_heads * head_dim
    return element_bytes * (attention + num_hidden_states * config.hidden_size)


def weight_bytes(config: Any, element_bytes: int) -> int:
    """The weights of a Llama-shaped decoder (an estimate: embeddings, attention and
    a gated MLP per layer; every expert of a mixture of experts)."""
    hidden = config.hidden_size
    heads, kv_heads, head_dim = _attention_shape(config)
    intermediate = getattr(config, "intermediate_size", None) or 4 * hidden
    experts = getattr(config, "num_local_experts", None) or getattr(config, "num_experts", None) or 1
    embeddings = config.vocab_size * hidden * (1 if getattr(config, "tie_word_embeddings", False) else 2)
    layer = 2 * hidden * heads * head_dim + 2 * hidden * kv_heads * head_dim + 3 * hidden * intermediate * experts
    return element_bytes * (embeddings + config.num_hidden_layers * layer)
