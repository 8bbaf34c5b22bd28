"""What the extractor reads from a model's Hugging Face config, before any engine
exists: the engine, the CPU defaults and the command line all need it."""

from __future__ import annotations

from typing import Any


def text_config(model: str) -> Any:
    """The model's text config (``num_hidden_layers``, ``hidden_size``,
    ``vocab_size``), also for multimodal configs that nest it."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model)
    return getattr(config, "get_text_config", lambda: config)()
