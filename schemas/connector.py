"""The local contract between the extractor process and its connector, which runs
inside vLLM's engine processes: per-request parameters going in (through
``SamplingParams.extra_args["kv_transfer_params"]``), connector configuration
(through ``kv_connector_extra_config``), and completion reports coming back over
the completion channel."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, JsonValue, model_validator

from hsx.schemas.blocks import AttemptId, Codec
from hsx.schemas.manifest import SourceRef
from hsx.schemas.common import Capture, NonNegativeInt, PositiveInt, RequestId, StrictModel
from hsx.schemas.generation import GeneratedTurn, Generation

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
the copy to the host; :mod:`hsx.codecs.fp8` documents the error bound)."""


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


def request_bytes_bound(max_model_len: int, num_layers: int, hidden_size: int) -> int:
    """Raw bytes of the largest request an engine can finish: ``max_model_len``
    tokens of every hidden-state layer, at 4 bytes per element (which bounds every
    model dtype vLLM runs)."""
    return max_model_len * num_layers * hidden_size * 4


INLINE_BLOCK_BYTES = 1 << 20
"""Raw bytes of a block record inline: one Kafka record each, compressed to
about 0.7 MiB, which the blocks topics' ``max.message.bytes`` (8 MiB in k8s/)
holds with room."""
STAGED_BLOCK_BYTES = 8 << 20
"""Raw bytes of a block by reference, where no record limit applies.

Why larger: each block is a round of Python work with its own header,
checksums and zstd frames (and was, when this was chosen, a hand-off from the
compression pool to the stager); per byte, that overhead fell with the block's
size. ``bench.datapath``, connector side, CPU-seconds per GB, one round each: 1 MiB
1.88 / 1.83 (directory), 2.59 / 2.40 (S3); 8 MiB 1.63 / 1.52, 2.38 / 2.24;
4, 16 and 32 MiB within the noise of 8 (and fewer entries in a manifest)."""


class ConnectorConfig(StrictModel):
    """Connector settings chosen by the extractor."""

    completion_address: str
    """ZeroMQ address the extractor binds (``ipc://...``) and the connector pushes to."""
    kafka_settings_file: str
    """Path of a file (mode 0600, in the extractor's private temp directory) holding
    the extractor's Kafka settings as JSON, secrets included. Only the path is
    here because vLLM logs this configuration (``kv_connector_extra_config``)."""
    blocks_topic: str
    model: str
    """Model name recorded in every manifest."""
    codec: Codec = Codec.BYTEPLANE_ZSTD
    codec_level: int = 1
    wire_dtype: WireDType = "model"
    block_bytes: int | None = Field(default=None, ge=4096)
    """Target raw size of one block; blocks hold whole tokens. Unset: by
    transport (:attr:`target_block_bytes`)."""
    compress_threads: Annotated[int, Field(ge=1, le=64)] = 2
    """Threads encoding block records inline (by reference, each of the
    ``upload_threads`` encodes the blocks it writes)."""
    max_inflight_bytes: Annotated[int, Field(ge=1 << 20)] = 512 << 20
    """Raw hidden-state bytes gathered but not yet acknowledged by Kafka; requests
    beyond it wait in vLLM's cache (their blocks stay pinned)."""
    payload_store: str | None = None
    """By reference: each attempt's blocks go back to back into one object here
    (a directory the sinks can read, or ``s3://bucket/prefix``), and only the
    manifest goes to Kafka. Credentials come from the engine process's
    environment (the standard AWS chain), never from here: vLLM logs this
    configuration."""
    upload_threads: Annotated[int, Field(ge=1, le=64)] = 4
    """Attempts staged at once, by reference: each thread encodes its attempt's
    blocks in order and writes them."""
    max_request_bytes: PositiveInt
    """Raw bytes of the largest request the engine can finish
    (:func:`request_bytes_bound` of its ``max_model_len``). ``max_inflight_bytes``
    must hold it: the budget, and the producer's queue sized from it, are planned
    so that any request fits."""

    @property
    def target_block_bytes(self) -> int:
        """``block_bytes``, or when unset :data:`INLINE_BLOCK_BYTES` inline and
        :data:`STAGED_BLOCK_BYTES` by reference."""
        if self.block_bytes is not None:
            return self.block_bytes
        return INLINE_BLOCK_BYTES if self.payload_store is None else STAGED_BLOCK_BYTES

    @model_validator(mode="after")
    def _largest_request_fits(self) -> ConnectorConfig:
        if self.max_inflight_bytes < self.max_request_bytes:
            raise ValueError(
                f"max_inflight_bytes {self.max_inflight_bytes} cannot hold one request of max_model_len tokens "
                f"({self.max_request_bytes} raw bytes): raise it to at least that, or lower max_model_len")
        return self


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
