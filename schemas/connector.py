"""The local contract between the extractor process and its connector, which runs
inside vLLM's engine processes: per-request parameters going in (through
``SamplingParams.extra_args["kv_transfer_params"]``), connector configuration
(through ``kv_connector_extra_config``), and completion reports coming back over
the completion channel."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, JsonValue

from schemas.blocks import AttemptId, Codec, SourceRef
from schemas.common import Capture, NonNegativeInt, PositiveInt, RequestId, StrictModel
from schemas.generation import GeneratedTurn, Generation

PARAMS_KEY = "hsx"
"""Key of :class:`RequestParams` inside a request's ``kv_transfer_params``."""
DISCARD_KEY = "hsx_discard"
"""Set in a request's ``kv_transfer_params`` when nothing is to be sent for it (an
earlier turn of a chat regenerated turn by turn)."""
EXTRA_CONFIG_KEY = "hsx"
"""Key of :class:`ConnectorConfig` inside ``kv_connector_extra_config``."""
WireDType = Literal["model", "fp8"]
"""What block records carry: the rows in the model's dtype, or ``fp8`` (E4M3FN
codes and a float32 scale per token and layer, quantized on the device before
the copy to the host; :mod:`schemas.fp8` documents the error bound)."""


class RequestParams(StrictModel):
    """What the connector needs to know about one request beyond its tokens."""

    request_id: RequestId
    attempt_id: AttemptId
    source: SourceRef
    loss_mask_spans: list[tuple[NonNegativeInt, PositiveInt]] | None = None
    metadata: dict[str, JsonValue] | None = None
    generation: Generation | None = None
    """Set when the engine generates: the connector then captures every input token
    (prompt and answer) and records the answer in the manifest."""
    capture: Capture = "all"
    earlier_turns: list[GeneratedTurn] | None = None
    """Answers the extractor generated before this final pass (turn-by-turn
    regeneration); they are part of the prompt tokens and of the loss mask."""


class ConnectorConfig(StrictModel):
    """Connector settings chosen by the extractor. Kafka connection and security
    settings are *not* here: vLLM logs its configuration, so the connector reads
    them from the ``HSX_KAFKA_*`` environment it inherits."""

    completion_address: str
    """ZeroMQ address the extractor binds (``ipc://...``) and the connector pushes to."""
    blocks_topic: str
    model: str
    """Model name recorded in every manifest."""
    codec: Codec = Codec.BYTEPLANE_ZSTD
    codec_level: int = 1
    wire_dtype: WireDType = "model"
    block_bytes: Annotated[int, Field(ge=4096)] = 1 << 20
    """Target raw size of one block record; blocks hold whole tokens."""
    compress_threads: Annotated[int, Field(ge=1, le=64)] = 2
    max_inflight_bytes: Annotated[int, Field(ge=1 << 20)] = 512 << 20
    """Raw hidden-state bytes gathered but not yet acknowledged by Kafka; requests
    beyond it wait in vLLM's cache (their blocks stay pinned)."""


class CompletionReport(StrictModel):
    """The connector's verdict on one request attempt."""

    request_id: RequestId
    attempt_id: AttemptId
    ok: bool
    error: str | None = None
    num_tokens: NonNegativeInt = 0
    raw_bytes: NonNegativeInt = 0
    compressed_bytes: NonNegativeInt = 0
