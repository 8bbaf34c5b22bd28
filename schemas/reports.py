"""The report channel from the connector, inside vLLM's engine, to whoever
listens (the extractor, ``hsx serve``): one message per request attempt
(:class:`CompletionReport`), per file (:class:`FileReport`), per promise a
response made (:class:`PromiseReport`), the Kafka side's state every
second (:class:`KafkaState`), and each promoted draft an engine took up or
refused (:class:`DraftSwapReport`). ZeroMQ over ``ipc://``, JSON."""

from __future__ import annotations

from typing import Literal

from hsx.schemas.blocks import AttemptId
from hsx.schemas.common import NonNegativeInt, RequestId, StrictModel


class CompletionReport(StrictModel):
    """The connector's verdict on one request attempt."""

    request_id: RequestId
    attempt_id: AttemptId
    ok: bool
    error: str | None = None
    refused: bool = False
    """Kafka refused a record (its delivery report carried an error); the
    extractor must stop (exit 1) rather than retry."""
    num_tokens: NonNegativeInt = 0
    raw_bytes: NonNegativeInt = 0
    compressed_bytes: NonNegativeInt = 0
    kafka_bytes: NonNegativeInt = 0
    """Bytes of the records the attempt put on the blocks topic (keys, values,
    headers): the blocks and the manifest inline, the manifest alone by reference."""
    seconds: float | None = None
    """From the request's end in the engine (when its response left) to this
    report: the capture's lag."""


class PromiseReport(StrictModel):
    """The connector's scheduler side named a file or a sample in a response:
    a capture ``hsx serve`` must see completed (a :class:`FileReport`, a
    :class:`CompletionReport`) or count as lost (the engine died first)."""

    promised: Literal[True] = True
    path: str | None = None
    sample_id: str | None = None


class KafkaState(StrictModel):
    """The connector's Kafka side, every second, for ``hsx serve``'s readiness
    and gauges: whether Kafka keeps up, and whether captures wait for room."""

    in_flight: NonNegativeInt
    in_flight_bytes: NonNegativeInt
    unacknowledged_s: float
    """Since Kafka last acknowledged a record, while any is in flight (else 0)."""
    full_s: float
    """Since the in-flight budget first refused a capture, while it still does
    (else 0): finished requests keep their blocks, so vLLM admits fewer."""


class FileReport(StrictModel):
    """The connector's word on one request's file, for ``hsx serve``'s counts."""

    path: str
    ok: bool
    error: str | None = None
    raw_bytes: NonNegativeInt = 0
    seconds: float | None = None
    """From the request's end in the engine to the file complete (unlocked)."""
    earlier: bool = False
    """Promised by an earlier server on the same directory that died before writing
    it (found at this one's start): its loss, not this server's."""


class DraftSwapReport(StrictModel):
    """A server's engine took up a promoted draft, or refused it."""

    version: NonNegativeInt
    path: str
    outcome: Literal["swapped", "refused"]
    reason: str | None = None
    """Why a draft was refused: it did not load, holds NaN or inf, or does not fit
    the served draft (tensors, vocabulary, hidden size, layers)."""


class SpeculationReport(StrictModel):
    """What vLLM counted of one served request's drafts (``hsx serve --draft``):
    ``hsx serve``'s live acceptance per draft version comes from these."""

    draft_version: NonNegativeInt
    verify_steps: NonNegativeInt
    accepted_per_position: list[NonNegativeInt]


Report = CompletionReport | FileReport | PromiseReport | KafkaState | DraftSwapReport | SpeculationReport
"""Any message on the report channel: what the connector sends and ``hsx serve`` reads."""

