"""The ``tiny-llama`` recipe: a tiny random Llama with a BPE tokenizer trained here.

Builds in seconds; its outputs are meaningless, but it takes the same code paths as a real
model. Seed and corpus are fixed, so every build is byte-identical.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from importlib import resources
from pathlib import Path
from typing import Any

from hsx.models.cache import Recipe, check_saved_config

# Bump whenever the output changes (see `Recipe`).
TINY_LLAMA_RECIPE = "tiny-llama/1"

TINY_SEED = 1234
TINY_VOCAB_SIZE = 1000
TINY_MAX_POSITIONS = 2048

# Training text for the tokenizer, one JSON string per line (some sentences hold newlines).
# Mixed prose, digits, punctuation, code and ChatML so the merges cover what the tests send;
# byte-level BPE still encodes anything else.
TINY_CORPUS_FILE = "tiny_corpus.jsonl"

ENDOFTEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
# Listed in this order so the ids (0, 1, 2) match SmolLM2's, and code that special-cases
# them behaves the same on both models.
TINY_SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END)

# SmolLM2's ChatML template without its default system prompt (which names SmolLM).
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def build_tiny_llama(dest: Path) -> None:
    """Write the tiny-llama tokenizer, config and float32 weights into ``dest``."""
    tokenizer = train_tiny_tokenizer()
    tokenizer.save_pretrained(dest)
    model = _init_tiny_llama(_tiny_llama_config(tokenizer))
    model.save_pretrained(dest)  # safetensors is the default
    check_saved_config(dest)


def tiny_corpus() -> tuple[str, ...]:
    """Return the tokenizer's training sentences, in file order (the merges depend on it)."""
    text = (resources.files("hsx.models") / TINY_CORPUS_FILE).read_text(encoding="utf-8")
    return tuple(json.loads(line) for line in text.splitlines())


def train_tiny_tokenizer(extra_tokens: Sequence[str] = ()) -> Any:
    """Train a byte-level BPE on ``tiny_corpus()`` and wrap it as a ``PreTrainedTokenizerFast``.

    ``extra_tokens`` are added after training as added (not special) tokens, one id each,
    after the BPE vocabulary; tiny-llama adds none.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    # Byte-level pre-tokenizer with the full 256-byte alphabet: any text encodes, no <unk>.
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TINY_VOCAB_SIZE,
        min_frequency=1,
        special_tokens=list(TINY_SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(tiny_corpus(), trainer=trainer)
    # bos/eos follow SmolLM2; pad is a token of its own so padding never looks like an end.
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=IM_START,
        eos_token=IM_END,
        pad_token=ENDOFTEXT,
        unk_token=ENDOFTEXT,
        model_max_length=TINY_MAX_POSITIONS,
    )
    if extra_tokens:
        tokenizer.add_tokens(list(extra_tokens))
    tokenizer.chat_template = CHATML_TEMPLATE
    return tokenizer


def _tiny_llama_config(tokenizer: Any) -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(**tiny_text_sizes(tokenizer))


def tiny_text_sizes(tokenizer: Any) -> dict[str, Any]:
    """The tiny decoders' shared config fields: their sizes and special tokens."""
    return dict(
        # Exactly the tokenizer's size: no embedding rows that no text can produce.
        vocab_size=len(tokenizer),
        hidden_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        intermediate_size=256,
        max_position_embeddings=TINY_MAX_POSITIONS,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        dtype="float32",
    )


def seeded(model_class: Any, config: Any) -> Any:
    """``model_class(config)`` with random weights from ``TINY_SEED``, float32, eval mode."""
    import torch

    # fork_rng keeps the caller's global RNG state untouched by our fixed seed.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(TINY_SEED)
        model = model_class(config)
    return model.to(torch.float32).eval()


def _init_tiny_llama(config: Any) -> Any:
    from transformers import LlamaForCausalLM

    return seeded(LlamaForCausalLM, config)


RECIPE = Recipe("tiny-llama", TINY_LLAMA_RECIPE, build_tiny_llama)
