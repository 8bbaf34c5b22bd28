"""The local contract between the extractor process and its connector, which runs
inside vLLM's engine processes: per-request parameters going in (through
``SamplingParams.extra_args["kv_transfer_params"]``), connector configuration
(through ``kv_connector_extra_config``), and completion reports coming back over
the completion channel."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import Field, JsonValue, field_validator, model_validator

from hsx.schemas.blocks import AttemptId, Codec
from hsx.schemas.limits import DEFAULT_LIMITS, check_json_bounds
from hsx.schemas.manifest import ServedRef, SourceRef
from hsx.schemas.topics import BLOCKS
from hsx.schemas.common import Capture, NonNegativeInt, PositiveInt, RequestId, StrictModel
from hsx.schemas.drafts import Speculation
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
    source: SourceRef | ServedRef
    loss_mask_spans: list[tuple[NonNegativeInt, PositiveInt]] | None = None
    metadata: dict[str, JsonValue] | None = None
    generation: Generation | None = None
    """Set when the engine generates: the connector then captures every input token
    (prompt and answer) and records the answer in the manifest."""
    capture: Capture = "all"
    earlier_turns: list[GeneratedTurn] | None = None
    """Answers the extractor generated before this final pass (turn-by-turn
    regeneration); they are part of the prompt tokens and of the loss mask."""
    speculation: Speculation | None = None
    """A request served with a draft: which draft, and what of it was accepted."""


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


RequestSource = Literal["served", "extractor"]


class ConnectorConfig(StrictModel):
    """The connector's Kafka side: chosen by the extractor, or by whoever runs
    vLLM's server (``hsx serve``, or ``kv_connector_extra_config.hsx`` by hand,
    where every field but ``requests`` may stay unset)."""

    requests: RequestSource = "served"
    """Who names the samples. ``served``: clients of vLLM's server; the connector
    gives each finished request a sample id of its own and reads the client's
    ``kv_transfer_params.hsx`` as :class:`ServedParams`. ``extractor``: every
    request carries the extractor's :class:`RequestParams`."""
    completion_address: str | None = None
    """ZeroMQ address the extractor (or ``hsx serve``) binds (``ipc://...``) and
    the connector pushes a :class:`CompletionReport` per attempt to; unset, the
    connector logs the attempts that fail."""
    kafka_settings_file: str | None = None
    """Path of a file (mode 0600, in the extractor's private temp directory) holding
    the extractor's Kafka settings as JSON, secrets included. Only the path is
    here because vLLM logs this configuration (``kv_connector_extra_config``).
    Unset: the engine process's ``HSX_KAFKA_*`` environment, as every hsx
    service reads it, with ``bootstrap`` over it."""
    bootstrap: str | None = None
    """Kafka's bootstrap servers where no ``kafka_settings_file`` is given."""
    blocks_topic: str = BLOCKS
    model: str | None = None
    """Model name recorded in every manifest; unset: the name vLLM serves it under."""
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
    max_request_bytes: PositiveInt | None = None
    """Raw bytes of the largest request the engine can finish
    (:func:`request_bytes_bound` of its ``max_model_len``; unset: the connector
    computes it). ``max_inflight_bytes`` must hold it: the budget, and the
    producer's queue sized from it, are planned so that any request fits."""

    @property
    def target_block_bytes(self) -> int:
        """``block_bytes``, or when unset :data:`INLINE_BLOCK_BYTES` inline and
        :data:`STAGED_BLOCK_BYTES` by reference."""
        if self.block_bytes is not None:
            return self.block_bytes
        return INLINE_BLOCK_BYTES if self.payload_store is None else STAGED_BLOCK_BYTES

    @model_validator(mode="after")
    def _extractor_says_where(self) -> ConnectorConfig:
        if self.requests == "extractor" and (self.completion_address is None or self.kafka_settings_file is None):
            raise ValueError("requests from the extractor need its completion_address and kafka_settings_file")
        return self

    @model_validator(mode="after")
    def _largest_request_fits(self) -> ConnectorConfig:
        if self.max_request_bytes is not None and self.max_inflight_bytes < self.max_request_bytes:
            raise ValueError(
                f"max_inflight_bytes {self.max_inflight_bytes} cannot hold one request of max_model_len tokens "
                f"({self.max_request_bytes} raw bytes): raise it to at least that, or lower max_model_len")
        return self


FILES_KEYS = ("shared_storage_path", "allow_custom_save_path", "num_writer_threads", "max_pending_file_bytes",
              "files_ttl_s", "files_max_bytes")
"""The keys of :class:`FilesConfig`, read from the top level of
``kv_connector_extra_config``, where vLLM's own hidden-states connector reads
the first three."""
HIDDEN_STATES_PATH_KEY = "hidden_states_path"
"""In a response's ``kv_transfer_params``: the file holding the request's hidden
states (vLLM's stock contract). In a request's: the path a client asks for,
honoured only under ``allow_custom_save_path``."""
INCLUDE_OUTPUT_KEY = "include_output_tokens"
"""In a request's ``kv_transfer_params``: capture the generated tokens too (all
but the final one, which was never an input), as the stock connector does."""
SAMPLE_ID_KEY = "sample_id"
"""In a response's ``kv_transfer_params``: the id of the request's sample in
the dataset, when the connector sends served requests to Kafka."""
DRAFT_VERSION_KEY = "draft_version"
"""In a response's ``kv_transfer_params``, serving with a draft: the version of
the draft the engine served when the request finished (``hsx.schemas.drafts``)."""
CAPTURE_ERROR_KEY = "hsx_error"
"""In a response's ``kv_transfer_params``: why the request's hidden states were
not captured (its ``hsx`` parameters were invalid)."""


class FilesConfig(StrictModel):
    """The file per request, as vLLM's ``ExampleHiddenStatesConnector`` writes it:
    ``<shared_storage_path>/<request>.safetensors`` with ``hidden_states``
    ``[T, L, H]`` and ``token_ids`` ``[T]``, guarded by ``<path>.lock``."""

    shared_storage_path: str = Field(min_length=1)
    allow_custom_save_path: bool = False
    """Honour a request's own ``hidden_states_path``. Unlike the stock
    connector's, such a path must still lie inside ``shared_storage_path``: a
    client never chooses where outside it the server writes."""
    num_writer_threads: Annotated[int, Field(ge=1, le=64)] = 4
    max_pending_file_bytes: Annotated[int, Field(ge=1 << 20)] = 512 << 20
    """Raw hidden-state bytes gathered but not yet written; finished requests
    beyond it wait in vLLM's cache (their blocks stay pinned), as the Kafka
    side's ``max_inflight_bytes`` does."""
    files_ttl_s: float | None = Field(default=None, gt=0)
    """Files no reader deleted are deleted this long after they were written
    (their lock files too); unset: kept until someone deletes them."""
    files_max_bytes: int | None = Field(default=None, ge=1 << 20)
    """Bytes of files kept at most: a file that would pass it is not written
    (the capture is refused and counted, the request answered); unset: no bound."""


class ServedParams(StrictModel):
    """What a client of vLLM's server may put under ``kv_transfer_params.hsx``."""

    capture: bool | Capture = True
    """``false``: no hidden states for this request; ``"last"``: only the final
    input token's row (a reward or classifier head's input)."""
    metadata: dict[str, JsonValue] | None = None
    """Recorded with the request's sample in the dataset, bounded as a prompt
    event's metadata is."""

    @field_validator("metadata")
    @classmethod
    def _bounded(cls, value: dict[str, JsonValue] | None) -> dict[str, JsonValue] | None:
        if value is not None:
            check_json_bounds("metadata", value, DEFAULT_LIMITS.max_metadata_bytes, DEFAULT_LIMITS.max_metadata_depth)
        return value


REPORTS_KEY = "hsx_reports"
"""In ``kv_connector_extra_config``: a ZeroMQ address (``hsx serve``'s) the
connector pushes a report of every capture to, files and samples alike."""
DRAFTS_KEY = "hsx_drafts"
"""With an EAGLE-3 draft: the drafts directory whose ``promoted.json`` the engine
follows, swapping each promoted draft in (``hsx.schemas.drafts``)."""


@dataclass(frozen=True)
class ExtraConfig:
    """``kv_connector_extra_config`` read: the Kafka side, the file side, or both."""

    kafka: ConnectorConfig | None
    files: FilesConfig | None
    reports: str | None = None
    drafts: str | None = None

    @property
    def report_address(self) -> str | None:
        """Where reports go: the extractor's completion channel, else ``hsx_reports``."""
        return (self.kafka.completion_address if self.kafka else None) or self.reports


def read_extra_config(extra: Mapping[str, Any] | None) -> ExtraConfig:
    """The connector's two sides from vLLM's ``kv_connector_extra_config``:
    ``hsx`` holds :class:`ConnectorConfig` (hidden states to Kafka), the stock
    connector's keys (:data:`FILES_KEYS`) a :class:`FilesConfig`. Raises
    ``ValueError`` naming what is wrong: an unknown key, or neither side."""
    extra = dict(extra or {})
    known = [EXTRA_CONFIG_KEY, *FILES_KEYS, REPORTS_KEY, DRAFTS_KEY]
    unknown = sorted(set(extra) - set(known))
    if unknown:
        raise ValueError(f"kv_connector_extra_config: unknown keys {unknown}; HsxConnector reads {known}")
    files = {key: extra[key] for key in FILES_KEYS if key in extra}
    if files and "shared_storage_path" not in files:
        raise ValueError(f"kv_connector_extra_config sets {sorted(files)} but not shared_storage_path")
    if extra.get(EXTRA_CONFIG_KEY) is None and not files:
        raise ValueError("kv_connector_extra_config needs shared_storage_path (a file per request) or "
                         f"{EXTRA_CONFIG_KEY!r} (hsx's Kafka settings), or both")
    kafka = extra.get(EXTRA_CONFIG_KEY)
    return ExtraConfig(
        kafka=None if kafka is None else ConnectorConfig.model_validate(kafka, strict=False),
        files=FilesConfig.model_validate(files, strict=False) if files else None,
        reports=extra.get(REPORTS_KEY),
        drafts=extra.get(DRAFTS_KEY),
    )
