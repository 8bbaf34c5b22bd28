"""Reference hidden states from HF transformers: the independent implementation
hsx is checked against (tests, demo, benchmarks)."""

from __future__ import annotations

from pathlib import Path

import torch


class HFReference:
    """Hidden states with vLLM's layer-id convention: id ``L < num_hidden_layers``
    is HF's ``output_hidden_states[L]``; id ``num_hidden_layers`` is the input of
    the final norm (HF's last entry is after the norm)."""

    def __init__(self, model_dir: Path) -> None:
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        self.num_layers: int = self.model.config.num_hidden_layers

    @torch.no_grad()
    def hidden_states(self, token_ids: list[int], layer_ids: list[int]) -> torch.Tensor:
        """``[len(token_ids), len(layer_ids), hidden_size]`` in float32."""
        captured: dict[str, torch.Tensor] = {}
        hook = self.model.model.norm.register_forward_pre_hook(lambda _m, args: captured.update(pre_norm=args[0]))
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
