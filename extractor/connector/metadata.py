"""What the scheduler side hands the worker side each step."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata


@dataclass
class SendJob:
    """One finished request whose hidden states must be sent."""

    engine_request_id: str
    """vLLM's internal id (the app id plus a random suffix): what
    ``finished_sending`` must report."""
    block_ids: list[int]
    """The request's blocks in the hidden-state cache group, in token order."""
    token_ids: list[int]
    params: dict[str, Any]
    """``schemas.connector.RequestParams`` as a dict (validated on the worker)."""


@dataclass
class HsxConnectorMetadata(KVConnectorMetadata):
    sends: list[SendJob] = field(default_factory=list)
