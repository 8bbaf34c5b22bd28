"""What the scheduler side hands the worker side each step."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

from hsx.schemas import GeneratedTurn, GenerationRecord
from hsx.schemas.connector import RequestParams
from hsx.schemas.drafts import PromotedDraft

if TYPE_CHECKING:
    from vllm.v1.request import Request


@dataclass
class SendJob:
    """One finished request whose hidden states must be sent."""

    engine_request_id: str
    """vLLM's internal id (the app id plus a random suffix): what
    ``finished_sending`` must report."""
    block_ids: list[int]
    """The request's blocks in the hidden-state cache group, in token order."""
    token_ids: list[int]
    params: dict[str, Any] | None
    """``hsx.schemas.connector.RequestParams`` as a dict (validated on the worker):
    the sample to send to Kafka, or ``None`` when only a file is written."""
    answer: GeneratedTail | None = None
    """Set when the request generated (``token_ids`` then end before its final token)."""
    first_row: int = 0
    """The first token position whose hidden states are sent (``capture: last``:
    only the final input token's); the gather copies only those rows."""
    file_path: str | None = None
    """Where the request's file goes (:mod:`hsx.extractor.connector.files`), if anywhere."""
    finished_at: float = 0.0
    """``time.time()`` when the request ended on the scheduler side (its response
    left then): the start of its capture lag."""

    @property
    def rows(self) -> int:
        return len(self.token_ids) - self.first_row


@dataclass(frozen=True)
class GeneratedTail:
    """What the scheduler knows of a generated answer: where it starts, its final
    token (never an input, so not in ``token_ids``) and why it ended."""

    prompt_tokens: int
    final_token_id: int
    finish_reason: str
    """``stop`` or ``length`` (``hsx.schemas.FinishReason``)."""


@dataclass
class HsxConnectorMetadata(KVConnectorMetadata):
    sends: list[SendJob] = field(default_factory=list)
    holds: list[str] = field(default_factory=list)
    """Files of requests scheduled for the first time: their locks are taken in this step."""
    drops: list[str] = field(default_factory=list)
    """Files of requests that finished without any to write (aborted)."""
    prepare: PromotedDraft | None = None
    """A promoted draft every rank loads and checks off the step (:mod:`.draft_swap`)."""
    swap_to: int | None = None
    """The prepared draft version every rank swaps in before this step's forward pass."""


def answer_fields(job: SendJob, params: RequestParams) -> dict[str, Any]:
    """The manifest's ``generation`` and ``loss_mask_spans`` for ``job``: the
    generated tokens that are inputs (all but the final one) join the loss mask,
    after the given or earlier generated turns the extractor put there. A served
    response (``hsx serve``: an answer, no ``generation``) is masked to its
    answer alone: what a draft learns to propose is the verifier's answers, not
    its prompts (the chat template's system turn, the same in every sample, would
    be learned and scored as if it were drafted)."""
    if job.answer is None:
        return {"loss_mask_spans": params.loss_mask_spans, "capture": params.capture}
    answer = job.answer
    spans = list(params.loss_mask_spans or [])
    if answer.prompt_tokens < len(job.token_ids):
        spans.append((answer.prompt_tokens, len(job.token_ids)))
    if params.generation is None:
        return {"loss_mask_spans": spans, "capture": params.capture}
    turn = GeneratedTurn(token_start=answer.prompt_tokens, token_end=len(job.token_ids) + 1,
                         finish_reason=answer.finish_reason)  # type: ignore[arg-type]
    turns = [*(params.earlier_turns or []), turn]
    record = GenerationRecord(params=params.generation, turns=turns, final_token_id=answer.final_token_id)
    return {"loss_mask_spans": spans, "generation": record, "capture": params.capture}


def send_job(request: Request, block_ids: list[int], params: dict[str, Any] | None, capture: str,
              file: str | None, include_output: bool) -> SendJob:
    """What the worker side sends for a finished request. A plain prefill sends the
    prompt's tokens; a generation (or ``include_output_tokens``) sends every token
    that was an input of a forward pass (prompt + answer, but not the final token,
    which never was one) and records the answer."""
    from vllm.v1.request import FinishReason

    if (params is None or params.get("generation") is None) and not include_output:
        tokens, answer = list(request.prompt_token_ids or []), None
    else:
        every = list(request.all_token_ids)
        tokens = every[:-1]
        answer = GeneratedTail(prompt_tokens=request.num_prompt_tokens, final_token_id=every[-1],
                               finish_reason="stop" if request.get_finished_reason() == FinishReason.STOP else "length")
    first_row = len(tokens) - 1 if capture == "last" else 0
    return SendJob(request.request_id, list(block_ids), tokens, params, answer, first_row, file, time.time())
