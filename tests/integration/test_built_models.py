"""The built models (`hsx.models`): their files, configs, tokenizers and chat templates, in transformers."""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from hsx import models
from hsx.reference import load_hf_model
from tests.integration.model_helpers import marker


@pytest.fixture(scope="session")
def load_hf(prepared: dict[str, Path]) -> Callable[[str], tuple[Any, Any]]:
    """Load (tokenizer, model) of a prepared model with transformers, once per session."""

    @functools.cache
    def load(name: str) -> tuple[Any, Any]:
        from transformers import AutoTokenizer

        path = prepared[name]
        return AutoTokenizer.from_pretrained(path), load_hf_model(path)

    return load


ARCHITECTURES = {
    "tiny-llama": "LlamaForCausalLM",
    "smollm2-135m-instruct": "LlamaForCausalLM",
    "tiny-qwen3": "Qwen3ForCausalLM",
    "tiny-qwen2.5-vl": "Qwen2_5_VLForConditionalGeneration",
}


@pytest.mark.parametrize("name", models.MODEL_NAMES)
def test_model_dir_is_plain_float32(prepared: dict[str, Path], name: str) -> None:
    from safetensors import safe_open

    path = prepared[name]
    config = json.loads((path / "config.json").read_text())
    assert config["architectures"] == [ARCHITECTURES[name]]
    assert "quantization_config" not in config
    weights = sorted(path.glob("*.safetensors"))
    assert weights
    for file in weights:
        with safe_open(file, framework="pt") as handle:
            assert {handle.get_slice(key).get_dtype() for key in list(handle.keys())} == {"F32"}
    assert json.loads(marker(path).read_text())["recipe"]


@pytest.mark.parametrize("name", models.MODEL_NAMES)
def test_model_loads_in_transformers(load_hf: Callable[[str], tuple[Any, Any]], name: str) -> None:
    import torch

    tokenizer, model = load_hf(name)
    assert model.dtype == torch.float32
    assert tokenizer.chat_template
    ids = tokenizer("Hidden states, please.", return_tensors="pt").input_ids
    with torch.no_grad():
        out = model(ids, output_hidden_states=True)
    text = model.config.get_text_config()
    assert out.logits.shape == (1, ids.shape[1], text.vocab_size)
    assert len(out.hidden_states) == text.num_hidden_layers + 1
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


def test_tiny_qwen3_shape_and_thinking_switch(load_hf: Callable[[str], tuple[Any, Any]]) -> None:
    tokenizer, model = load_hf("tiny-qwen3")
    config = model.config
    assert (config.hidden_size, config.num_hidden_layers, config.intermediate_size) == (128, 4, 256)
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (4, 2, 32)
    assert config.vocab_size == len(tokenizer)
    assert tokenizer.eos_token == "<|im_end|>"
    think = tokenizer.convert_tokens_to_ids(["<think>", "</think>"])
    assert tokenizer("<think></think>", add_special_tokens=False).input_ids == think
    messages = [{"role": "user", "content": "Hi!"}]
    prompt = "<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n"
    render = functools.partial(
        tokenizer.apply_chat_template, messages, tokenize=False, add_generation_prompt=True
    )
    assert render() == render(enable_thinking=True) == prompt
    assert render(enable_thinking=False) == prompt + "<think>\n\n</think>\n\n"


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


def test_real_tiny_llama_build_is_deterministic(tmp_path: Path) -> None:
    # Fixed seed and corpus: two fresh builds must be byte-identical.
    first = models.prepare(tmp_path / "a", ["tiny-llama"])["tiny-llama"]
    second = models.prepare(tmp_path / "b", ["tiny-llama"])["tiny-llama"]
    for file in ("model.safetensors", "tokenizer.json", "config.json"):
        assert (first / file).read_bytes() == (second / file).read_bytes(), file
