"""The verifier's hidden states, captured out of the forward passes it runs while
it speculates with an EAGLE-3 draft: no extraction method, no second prefill.

vLLM hands an EAGLE-3 proposer the verifier's aux hidden states every step (the
inputs of the draft's chosen decoder layers). :func:`install`, a vLLM general
plugin, wraps ``GPUModelRunner._setup_eagle3_aux_hidden_state_outputs`` (the CPU
runner inherits it): where the engine speculates with ``eagle3`` and its KV
connector is HsxConnector, the verifier also returns its last layer before the
final norm (layer id ``num_hidden_layers``, what ``extract_hidden_states``
stores there), and after each forward pass :data:`STATES` writes the rows of
every layer into :class:`StateStore`, a tensor shaped like the dummy draft's
hidden-state cache (``[blocks, layers, block_size, hidden]``), at the slots the
verifier's KV cache gives the same tokens. The proposer still gets the draft's
layers alone.

Only accepted tokens remain: a step's rejected draft tokens are written at the
positions after the accepted ones, in the request's own blocks; vLLM rolls the
request back and a later step writes the tokens it accepts at those positions,
exactly as it overwrites their KV. So when a request finishes, positions
``[0, prompt + output - 1)`` hold the states of the tokens it answered with,
which is what the connector gathers (its blocks stay pinned until then, as with
``extract_hidden_states``). Prefix-cache hits share the blocks, and with them the
rows an earlier request wrote for the same tokens.

The store lives in the worker process; the connector's worker side allocates it
(:meth:`StateStore.allocate`, in ``register_kv_caches``, on the sending rank only)
and gathers from it, the runner writes it. Both run on vLLM's worker thread.
"""

from __future__ import annotations

import functools
import logging
import re
from dataclasses import dataclass, field
from typing import Any

import torch

log = logging.getLogger(__name__)

CONNECTOR = "HsxConnector"
METHOD = "eagle3"
_FIRST_LAYER = re.compile(r"(^|\.)layers\.0\.")


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


def verifier_group(kv_cache_config: Any) -> tuple[int, str]:
    """The KV cache group of the verifier's attention layers and the name of its
    first layer (``...layers.0...``), whose slot mapping places the rows. The
    draft's layers are numbered after the verifier's, so never match."""
    for index, group in enumerate(kv_cache_config.kv_cache_groups):
        for name in group.layer_names:
            if _FIRST_LAYER.search(name):
                return index, name
    names = [n for g in kv_cache_config.kv_cache_groups for n in g.layer_names]
    raise ValueError(f"cannot find the verifier's first attention layer (layers.0) among {names[:8]}")


@dataclass
class StateStore:
    """This worker's captured rows, indexed like the verifier's KV cache."""

    layer_ids: list[int] = field(default_factory=list)
    """Set by the runner: the layers each row holds, in this order."""
    draft_layers: int = 0
    """How many of the model's aux outputs the proposer gets (the first ones)."""
    cache: torch.Tensor | None = None
    """``[num_blocks, len(layer_ids), block_size, hidden]``; ``None`` where nothing captures (other ranks)."""
    slot_layer: str = ""
    block_size: int = 0
    runner: Any = None
    """vLLM's model runner, whose drafter :mod:`hsx.extractor.connector.draft_swap` loads promoted drafts into."""

    def allocate(self, num_blocks: int, block_size: int, hidden: int, dtype: torch.dtype, device: torch.device,
                 slot_layer: str) -> torch.Tensor:
        """The store for ``num_blocks`` blocks of the verifier's KV cache; what
        the connector gathers from."""
        if not self.layer_ids:
            raise RuntimeError("the verifier's capture hook is not installed: is the hsx vLLM plugin "
                               "(hsx_capture_while_speculating) disabled by VLLM_PLUGINS?")
        self.cache = torch.zeros(num_blocks, len(self.layer_ids), block_size, hidden, dtype=dtype, device=device)
        self.block_size, self.slot_layer = block_size, slot_layer
        log.info("capturing layers %s while speculating: %.1f MiB beside the KV cache", self.layer_ids,
                 self.cache.numel() * self.cache.element_size() / 2**20)
        return self.cache

    def write(self, aux: list[torch.Tensor]) -> None:
        """After a forward pass: each token's rows at its KV slot. Padding and
        dummy runs have slot -1; they land in block 0, vLLM's null block, which
        no request holds."""
        if self.cache is None:
            return
        from vllm.forward_context import get_forward_context

        mapping = get_forward_context().slot_mapping
        if isinstance(mapping, list):  # micro-batches: each has its part of the step's tokens
            slots = torch.cat([m[self.slot_layer] for m in mapping])
        else:
            slots = mapping.get(self.slot_layer) if mapping else None
        if slots is None:
            return
        n = min(slots.shape[0], aux[0].shape[0])
        slots = slots[:n].clamp(min=0)
        rows = torch.stack([h[:n] for h in aux], dim=1).to(self.cache.dtype)
        self.cache[slots // self.block_size, :, slots % self.block_size] = rows


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
    """1. Add the verifier's last layer to the aux outputs; 2. wrap the runner's
    forward so each pass writes the rows and hands the proposer the draft's layers."""
    from vllm.sequence import IntermediateTensors

    model = runner.get_model()
    holder = model.get_language_model() if hasattr(model, "get_language_model") else model
    holder = getattr(holder, "model", holder)
    draft = tuple(holder.aux_hidden_state_layers)
    last = runner.model_config.hf_text_config.num_hidden_layers
    model.set_aux_hidden_state_layers((*draft, last))
    STATES.layer_ids = sorted({*draft, last})
    STATES.runner = runner
    STATES.draft_layers = len(draft)
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
