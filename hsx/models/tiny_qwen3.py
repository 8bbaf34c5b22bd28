"""The ``tiny-qwen3`` recipe: a tiny random Qwen3 with the tiny BPE and a thinking switch.

Same tokenizer training and sizes as ``tiny-llama`` (see ``tiny_llama``), but the
``Qwen3ForCausalLM`` architecture (per-head q/k RMSNorm) and a chat template that, like
Qwen3's, appends an empty ``<think>\\n\\n</think>\\n\\n`` block after the generation prompt
when ``enable_thinking=False`` is passed. Builds in seconds and is byte-identical every time.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hsx.models.cache import Recipe, check_saved_config
from hsx.models.tiny_llama import seeded, tiny_text_sizes, train_tiny_tokenizer

# Bump whenever the output changes (see `Recipe`).
TINY_QWEN3_RECIPE = "tiny-qwen3/1"

THINK_START, THINK_END = "<think>", "</think>"
# Added (not special) tokens, as in Qwen3: one id each, kept by decode(skip_special_tokens=True).
THINK_TOKENS = (THINK_START, THINK_END)

# Qwen3's template reduced to what hsx relies on: ChatML turns, the generation prompt and
# the "thinking off" switch. Unlike Qwen3's, it never rewrites earlier assistant turns
# (Qwen3 strips their reasoning), so a conversation's prefixes render as prefixes of its
# full rendering, which is how hsx locates assistant turns.
QWEN3_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\\n' }}"
    "{% if enable_thinking is defined and enable_thinking is false %}"
    "{{ '<think>\\n\\n</think>\\n\\n' }}"
    "{% endif %}"
    "{% endif %}"
)


def build_tiny_qwen3(dest: Path) -> None:
    """Write the tiny-qwen3 tokenizer, config and float32 weights into ``dest``."""
    tokenizer = train_tiny_tokenizer(extra_tokens=THINK_TOKENS)
    tokenizer.chat_template = QWEN3_CHAT_TEMPLATE
    tokenizer.save_pretrained(dest)
    model = _init_tiny_qwen3(_tiny_qwen3_config(tokenizer))
    model.save_pretrained(dest)  # safetensors is the default
    check_saved_config(dest, "Qwen3ForCausalLM")


def _tiny_qwen3_config(tokenizer: Any) -> Any:
    from transformers import Qwen3Config

    return Qwen3Config(
        **tiny_text_sizes(tokenizer),  # the vocabulary: the BPE plus the think tokens
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},  # Qwen3's theta
        use_sliding_window=False,
        sliding_window=None,
    )


def _init_tiny_qwen3(config: Any) -> Any:
    from transformers import Qwen3ForCausalLM

    return seeded(Qwen3ForCausalLM, config)


RECIPE = Recipe("tiny-qwen3", TINY_QWEN3_RECIPE, build_tiny_qwen3)
