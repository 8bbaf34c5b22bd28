"""Hidden states without draft tokens: vLLM's ``extract_hidden_states`` method
run with zero speculative tokens a step.

The method's proposer returns each request's sampled token as a one-token
"draft", so every decode step runs one more token per request through the
verifier, to be rejected nearly always. Capture does not need it: the proposer's
dummy draft writes the hidden states of whatever tokens the step ran, the
sampled ones included. vLLM's dynamic speculative decoding
(``num_speculative_tokens_per_batch_size``) can schedule zero draft tokens a
step, and :data:`SCHEDULE` asks for zero at every batch size, but the proposer
asserts that it is asked for exactly one.

:func:`install` lets it be asked for zero: it still writes the step's hidden
states and proposes nothing, so a step runs the tokens plain decoding runs.
vLLM calls it in every engine and worker process as a general plugin
(``vllm.general_plugins`` in pyproject.toml; where ``VLLM_PLUGINS`` is set, it
must name ``hsx_no_draft_tokens``). Asked for one (the seed's configuration,
with no schedule) the proposer runs vLLM's code unchanged.
"""

from __future__ import annotations

import functools
from typing import Any

# (first batch size, last batch size, draft tokens): zero from one request up;
# vLLM carries the last range on to every larger batch.
SCHEDULE: list[list[int]] = [[1, 1, 0]]


def install() -> None:
    """Let ``ExtractHiddenStatesProposer.propose`` run with zero speculative
    tokens (idempotent)."""
    from vllm.v1.spec_decode.extract_hidden_states import ExtractHiddenStatesProposer

    one_draft = ExtractHiddenStatesProposer.propose
    if getattr(one_draft, "hsx_no_draft_tokens", False):
        return

    @functools.wraps(one_draft)
    def propose(self: ExtractHiddenStatesProposer, num_speculative_tokens: int, sampled_token_ids: Any,
                *args: Any, **kwargs: Any) -> Any:
        if num_speculative_tokens != 0:
            return one_draft(self, num_speculative_tokens, sampled_token_ids, *args, **kwargs)
        drafts = one_draft(self, self.num_speculative_tokens, sampled_token_ids, *args, **kwargs)
        return drafts[:, :0]

    propose.hsx_no_draft_tokens = True  # type: ignore[attr-defined]
    ExtractHiddenStatesProposer.propose = propose  # type: ignore[method-assign]
