"""The ``tiny-llama-eagle3`` recipe: an EAGLE-3 draft for ``tiny-llama`` in
speculators' format (what ``speculators train`` saves), which vLLM serves with its
``eagle3`` method.

An untrained draft proposes nothing the verifier accepts, so a test of capture
while speculating would never see an accepted draft token. This one is built
from the verifier's own weights to draft what the verifier would say next from
the input of its last decoder layer (aux layer 3 of ``[1, 2, 3]``): ``fc`` passes
that layer's slot through, the draft's decoder layer is the verifier's last one
(its attention reads the state half of its input, not the embedding; no norms
before ``fc`` or the residual), and its final norm and ``lm_head`` are the
verifier's (``lm_head`` scaled by 2: the same predictions, but the draft's own
tensor, as a trained draft's is; its embedding is the verifier's, shared). Given the verifier's state at position p its first proposal is the
token the verifier gave p + 1, again: accepted where tiny-llama's greedy answers
repeat a token (they fall into such loops), rejected where they move on. Every
answer thus has accepted and rejected draft tokens, deterministically, built in
seconds.
Full vocabulary (no ``d2t``/``t2d``: vLLM maps nothing), so any token can be proposed.
"""

from __future__ import annotations

import json
from pathlib import Path

from hsx.models import tiny_llama
from hsx.models.cache import Recipe, ensure

TINY_LLAMA_EAGLE3_RECIPE = "tiny-llama-eagle3/4"
AUX_LAYERS = [1, 2, 3]
"""The verifier layers the draft reads; ``fc`` uses the last (the input of tiny-llama's last decoder layer)."""


def build_tiny_llama_eagle3(dest: Path) -> None:
    """Write the draft's ``config.json`` and ``model.safetensors`` into ``dest``
    (the verifier is built beside it, in the same cache, if missing)."""
    import torch
    from safetensors.torch import load_file, save_file

    verifier = ensure(tiny_llama.RECIPE, dest.parent)
    config = json.loads((verifier / "config.json").read_text(encoding="utf-8"))
    weights = {k: v for path in sorted(verifier.glob("*.safetensors")) for k, v in load_file(path).items()}
    hidden, vocab = config["hidden_size"], config["vocab_size"]
    last = f"model.layers.{config['num_hidden_layers'] - 1}."
    fc = torch.zeros(hidden, len(AUX_LAYERS) * hidden)
    fc[:, -hidden:] = torch.eye(hidden)  # the input of the verifier's last decoder layer, unnormed

    def reads_state(weight: torch.Tensor) -> torch.Tensor:
        """A projection of [embedding, state] that ignores the embedding."""
        return torch.cat([torch.zeros_like(weight), weight], dim=1)

    tensors = {
        "embed_tokens.weight": weights["model.embed_tokens.weight"],
        "fc.weight": fc,
        "layers.0.hidden_norm.weight": weights[last + "input_layernorm.weight"],
        "layers.0.input_layernorm.weight": torch.ones(hidden),
        "layers.0.post_attention_layernorm.weight": weights[last + "post_attention_layernorm.weight"],
        **{f"layers.0.self_attn.{p}_proj.weight": reads_state(weights[f"{last}self_attn.{p}_proj.weight"])
           for p in "qkv"},
        **{f"layers.0.{name}.weight": weights[f"{last}{name}.weight"]
           for name in ("self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")},
        "norm.weight": weights["model.norm.weight"],
        # Twice the verifier's: the same argmax, but not identical, so vLLM keeps it the draft's own instead of
        # sharing the verifier's (as a trained draft's): a swapped-in draft may change it.
        "lm_head.weight": 2 * weights["lm_head.weight"],
    }
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(dest / "model.safetensors"))
    layer = {key: config[key] for key in ("hidden_size", "intermediate_size", "num_attention_heads",
                                          "num_key_value_heads", "head_dim", "rms_norm_eps", "vocab_size",
                                          "max_position_embeddings", "rope_parameters", "bos_token_id",
                                          "eos_token_id", "hidden_act")}
    draft_config = {
        "architectures": ["Eagle3DraftModel"],
        "speculators_model_type": "eagle3",
        "speculators_version": "0.9.0",
        "draft_vocab_size": vocab,
        "dtype": "float32",
        "eagle_aux_hidden_state_layer_ids": AUX_LAYERS,
        "norm_before_fc": False,
        "norm_before_residual": False,
        "norm_output": False,
        "fc_norm": False,
        "embed_requires_grad": False,
        "target_hidden_size": None,
        "tie_word_embeddings": False,
        "transformer_layer_config": {**layer, "model_type": "llama", "num_hidden_layers": 1,
                                     "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": False},
        "speculators_config": {
            "algorithm": "eagle3", "default_proposal_method": "greedy",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3, "accept_tolerance": 0.0,
                                  "verifier_accept_k": 1}],
            # As speculators writes it: where the verifier is (its trainer reads the verifier's config there).
            "verifier": {"architectures": config["architectures"], "name_or_path": str(verifier.resolve())},
        },
    }
    (dest / "config.json").write_text(json.dumps(draft_config, indent=2) + "\n", encoding="utf-8")


RECIPE = Recipe("tiny-llama-eagle3", TINY_LLAMA_EAGLE3_RECIPE, build_tiny_llama_eagle3)
