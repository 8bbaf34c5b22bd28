"""The verifier's hidden states, captured out of the forward passes it runs while
it speculates with an EAGLE-3 draft: no extraction method, no second prefill.

vLLM hands an EAGLE-3 proposer the verifier's aux hidden states every step (the
inputs of the draft's chosen decoder layers). :func:`install`, a vLLM general
plugin, wraps ``GPUModelRunner._setup_eagle3_aux_hidden_state_outputs`` (the CPU
runner inherits it): where the engine speculates with ``eagle3`` and its KV
connector is HsxConnector, the verifier also returns its last layer before the
final norm (layer id ``num_hidden_layers``, what ``extract_hidden_states``
stores there), and the runner gains one cache-only layer of vLLM's own
(``CacheOnlyAttentionLayer``, the dummy draft's, named :data:`LAYER_NAME`). vLLM
gives that layer a hidden-state KV cache group of its own (``[blocks, layers,
block_size, hidden]``), counted in the KV budget, with a block table per request,
freed and prefix-cached with the request's other blocks, exactly as the dummy
draft's cache. After each forward pass :data:`STATES` writes every token's rows
at that layer's slots. The proposer still gets the draft's layers alone.

Only accepted tokens remain: a step's rejected draft tokens are written at the
positions after the accepted ones, in the request's own blocks; vLLM rolls the
request back and a later step writes the tokens it accepts at those positions,
exactly as it overwrites their KV. So when a request finishes, positions
``[0, prompt + output - 1)`` hold the states of the tokens it answered with,
which is what the connector gathers (its blocks stay pinned until then, as with
``extract_hidden_states``). Prefix-cache hits share the blocks, and with them the
rows an earlier request wrote for the same tokens.

The cache lives in the worker process, bound by vLLM; the connector's worker side
gathers from it (it finds the layer as it finds the dummy draft's), the runner
writes it. Both run on vLLM's worker thread.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass, field, replace
from typing import Any

import torch

log = logging.getLogger(__name__)

CONNECTOR = "HsxConnector"
METHOD = "eagle3"
LAYER_NAME = "hsx_verifier_states.1000000"
"""The cache-only layer the runner gains: its KV cache holds the captured rows.
vLLM orders caches by the one integer in a layer's name: this one comes after
every layer a model or its draft has."""


def captures_while_speculating(vllm_config: Any) -> bool:
    """Whether this engine speculates with an EAGLE-3 draft and has HsxConnector:
    then the verifier's states are captured here instead of by a dummy draft."""
    spec = vllm_config.speculative_config
    transfer = vllm_config.kv_transfer_config
    return (spec is not None and spec.method == METHOD and transfer is not None
            and transfer.kv_connector == CONNECTOR)


def draft_layer_ids(vllm_config: Any) -> list[int]:
    """The verifier layers the EAGLE-3 draft reads (its config's
    ``eagle_aux_hidden_state_layer_ids``, as vLLM's runner reads them), ascending."""
    hf_config = vllm_config.speculative_config.draft_model_config.hf_config
    layers = getattr(hf_config, "eagle_aux_hidden_state_layer_ids", None)
    eagle_config = getattr(hf_config, "eagle_config", None)
    if not layers and isinstance(eagle_config, dict):
        layers = eagle_config.get("eagle_aux_hidden_state_layer_ids")
    if not layers:
        raise ValueError("the EAGLE-3 draft's config names no eagle_aux_hidden_state_layer_ids; hsx captures the "
                         "layers a draft names (speculators and hsx train-draft always write them)")
    return sorted(set(int(i) for i in layers))


def captured_layer_ids(vllm_config: Any) -> list[int]:
    """What a captured sample holds: the draft's layers, then the verifier's last
    (before the final norm), so a sample is exactly what that draft trains on."""
    last = vllm_config.model_config.hf_text_config.num_hidden_layers
    return sorted({*draft_layer_ids(vllm_config), last})


@dataclass
class StateStore:
    """What this worker's runner captures, and where."""

    layer_ids: list[int] = field(default_factory=list)
    """Set by the runner: the layers each row holds, in this order."""
    draft_layers: int = 0
    """How many of the model's aux outputs the proposer gets (the first ones)."""
    layer: Any = None
    """The cache-only layer whose KV cache (bound by vLLM) holds the rows."""
    runner: Any = None
    """vLLM's model runner, whose drafter :mod:`hsx.extractor.connector.draft_swap` loads promoted drafts into."""

    def write(self, aux: list[torch.Tensor]) -> None:
        """After a forward pass: each token's rows at its slot of the layer's
        cache. Padding and dummy runs have slot -1; they land in block 0,
        vLLM's null block, which no request holds."""
        from vllm.forward_context import get_forward_context
        from vllm.model_executor.models.extract_hidden_states import basic_cache

        cache = self.layer.kv_cache if self.layer is not None else None
        if cache is None or cache.numel() == 0:
            return  # before vLLM bound the cache (the profiling run)
        mapping = get_forward_context().slot_mapping
        if isinstance(mapping, list):  # micro-batches: each has its part of the step's tokens
            slots = torch.cat([m[LAYER_NAME] for m in mapping])
        else:
            slots = mapping.get(LAYER_NAME) if mapping else None
        if slots is None:
            return
        n = min(slots.shape[0], aux[0].shape[0])
        basic_cache(torch.stack([h[:n] for h in aux], dim=1).to(cache.dtype), cache, slots[:n])


STATES = StateStore()
"""The one store of this worker process."""


def install() -> None:
    """Let vLLM's runner capture the verifier's states while it speculates
    (idempotent; a no-op for every engine that does not, see :func:`captures_while_speculating`)."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    setup = GPUModelRunner._setup_eagle3_aux_hidden_state_outputs
    if getattr(setup, "hsx_capture", False):
        return

    @functools.wraps(setup)
    def setup_and_capture(self: GPUModelRunner) -> None:
        setup(self)
        if self.use_aux_hidden_state_outputs and captures_while_speculating(self.vllm_config):
            _capture_in(self)

    setup_and_capture.hsx_capture = True  # type: ignore[attr-defined]
    GPUModelRunner._setup_eagle3_aux_hidden_state_outputs = setup_and_capture  # type: ignore[method-assign]


def _capture_in(runner: Any) -> None:
    """1. Add the verifier's last layer to the aux outputs; 2. add the cache-only
    layer that holds the rows; 3. wrap the runner's forward so each pass writes
    the rows and hands the proposer the draft's layers."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.models.extract_hidden_states import CacheOnlyAttentionLayer
    from vllm.sequence import IntermediateTensors
    from vllm.utils.torch_utils import is_quantized_kv_cache

    model = runner.get_model()
    holder = model.get_language_model() if hasattr(model, "get_language_model") else model
    holder = getattr(holder, "model", holder)
    draft = tuple(holder.aux_hidden_state_layers)
    last = runner.model_config.hf_text_config.num_hidden_layers
    model.set_aux_hidden_state_layers((*draft, last))
    STATES.layer_ids = sorted({*draft, last})
    STATES.runner = runner
    STATES.draft_layers = len(draft)
    cache_config = runner.vllm_config.cache_config
    if is_quantized_kv_cache(cache_config.cache_dtype):  # hidden states keep the model's dtype, as the dummy draft's
        cache_config = replace(cache_config, cache_dtype="auto")
    # After the drafter loaded: the proposer counts as its own only the layers its loading added.
    with set_current_vllm_config(runner.vllm_config):
        STATES.layer = CacheOnlyAttentionLayer(num_heads=len(STATES.layer_ids),
                                               head_size=runner.model_config.get_hidden_size(),
                                               cache_config=cache_config, prefix=LAYER_NAME)
    hands_all = last in draft  # the draft itself reads the last layer: nothing to take away
    forward = runner._model_forward

    @functools.wraps(forward)
    def forward_and_capture(*args: Any, **kwargs: Any) -> Any:
        output = forward(*args, **kwargs)
        if not isinstance(output, tuple) or isinstance(output[0], IntermediateTensors):
            return output  # not the last pipeline stage
        hidden, aux = output
        STATES.write(aux)
        return hidden, aux if hands_all else aux[:STATES.draft_layers]

    runner._model_forward = forward_and_capture
    log.info("verifier states captured while speculating: layers %s (the draft reads %s)", STATES.layer_ids, draft)
