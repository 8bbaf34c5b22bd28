"""Drafts a server speculates with: what a sample records of its speculation,
the pointer a gate publishes to promote a draft (or roll one back), and what a
server reports of each swap.

A server follows a drafts directory (``hsx serve --drafts DIR``): whenever
``DIR/promoted.json`` (:class:`PromotedDraft`, written atomically) names a new
version, every engine loads that checkpoint beside the draft it serves, checks
it, and swaps it in between two engine steps, all ranks at the same step; a
checkpoint that fails its checks is refused with its reason and the server
keeps its draft (``hsx.schemas.reports.DraftSwapReport``). Version 0 is the
draft the server started with."""

from __future__ import annotations

from pydantic import Field

from hsx.schemas.common import NonNegativeInt, StrictModel

PROMOTED_FILE = "promoted.json"
"""The pointer's name in a drafts directory."""


class PromotedDraft(StrictModel):
    """The draft servers should speculate with now."""

    version: NonNegativeInt
    """Increases with every promotion and rollback; a server swaps when it sees a
    version other than its own."""
    path: str = Field(min_length=1)
    """The checkpoint directory (speculators' format): absolute, or relative to
    the drafts directory."""
    reason: str | None = None
    """Why: the gate's score, or which version a rollback undoes."""


class Speculation(StrictModel):
    """How a served request was drafted, counted by vLLM for that request."""

    draft_version: NonNegativeInt
    """The draft the engine served when the request finished (0: the one it started with)."""
    verify_steps: NonNegativeInt
    """Steps that verified draft tokens for this request."""
    draft_tokens: NonNegativeInt
    accepted_per_position: list[NonNegativeInt]
    """Steps whose draft was accepted up to position i + 1, for i in 0..K-1;
    mean acceptance length = 1 + sum / verify_steps."""
