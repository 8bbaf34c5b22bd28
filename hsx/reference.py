"""Reference hidden states from HF transformers: the independent implementation
hsx is checked against (tests, demo, benchmarks)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch


def load_hf_model(model_dir: Path) -> Any:
    """The model in float32, eval mode: a vision-language model (a config with a
    ``vision_config``) as ``AutoModelForImageTextToText``, any other as
    ``AutoModelForCausalLM``."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    config = AutoConfig.from_pretrained(model_dir)
    auto = AutoModelForImageTextToText if hasattr(config, "vision_config") else AutoModelForCausalLM
    return auto.from_pretrained(model_dir, config=config, dtype=torch.float32).eval()


class HFReference:
    """Hidden states with vLLM's layer-id convention: id ``L < num_hidden_layers``
    is HF's ``output_hidden_states[L]``; id ``num_hidden_layers`` is the input of
    the final norm (HF's last entry is after the norm). A vision-language model's
    are its language model's, for text prompts."""

    def __init__(self, model_dir: Path) -> None:
        self.model = load_hf_model(model_dir)
        self.num_layers: int = self.model.config.get_text_config().num_hidden_layers
        decoder = self.model.model
        self._final_norm = getattr(decoder, "language_model", decoder).norm

    @torch.no_grad()
    def hidden_states(self, token_ids: list[int], layer_ids: list[int]) -> torch.Tensor:
        """``[len(token_ids), len(layer_ids), hidden_size]`` in float32."""
        captured: dict[str, torch.Tensor] = {}
        hook = self._final_norm.register_forward_pre_hook(lambda _m, args: captured.update(pre_norm=args[0]))
        try:
            out = self.model(torch.tensor([token_ids]), output_hidden_states=True)
        finally:
            hook.remove()
        layers = [captured["pre_norm"][0] if i == self.num_layers else out.hidden_states[i][0] for i in layer_ids]
        return torch.stack(layers, dim=1)


    @torch.no_grad()
    def greedy(self, token_ids: list[int], max_new_tokens: int, stop_token_ids: tuple[int, ...] = ()) -> list[int]:
        """Greedy decoding (the argmax at every step) of up to ``max_new_tokens``
        after ``token_ids``, ending after a token of ``stop_token_ids``: nothing
        else stops it, as vLLM with ``ignore_eos`` and ``stop_token_ids``."""
        ids = list(token_ids)
        past = None
        step = torch.tensor([ids])
        for _ in range(max_new_tokens):
            out = self.model(step, past_key_values=past, use_cache=True)
            past = out.past_key_values
            token = int(out.logits[0, -1].argmax())
            ids.append(token)
            if token in stop_token_ids:
                break
            step = torch.tensor([[token]])
        return ids[len(token_ids):]


def max_relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """``max |actual - expected| / max |expected|``."""
    return float((actual.float() - expected).abs().max() / expected.abs().max())
