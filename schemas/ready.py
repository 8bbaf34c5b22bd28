"""The ``hidden_states.ready`` event: one per sample, published only after the
shard holding it is durable. Trainers consume these."""

from __future__ import annotations

import hashlib
from pathlib import PurePosixPath
from typing import Annotated, Literal

from pydantic import AfterValidator, Field, JsonValue

from hsx.schemas.blocks import Checksum, DType, PositiveInt
from hsx.schemas.common import SCHEMA_VERSION, SOURCE_ID_CHARS, Capture, NonNegativeInt, RequestId, StrictModel
from hsx.schemas.dataset_codec import DatasetCodec
from hsx.schemas.drafts import Speculation
from hsx.schemas.generation import GenerationRecord


def _relative_path(value: str) -> str:
    path = PurePosixPath(value)
    if path.is_absolute() or ".." in path.parts or not path.parts or "\\" in value:
        raise ValueError("must be a relative POSIX path inside the dataset, without '..'")
    return value


RelativePath = Annotated[str, AfterValidator(_relative_path)]


class TensorNames(StrictModel):
    """Names of a sample's tensors inside its shard."""

    hidden_states: str
    token_ids: str
    loss_mask: str | None = None


class HiddenStatesReady(StrictModel):
    """A sample is durable: where it is and what it holds."""

    schema_version: Literal[1] = SCHEMA_VERSION
    event_id: Annotated[str, Field(pattern=r"^[0-9a-f]{32}$")]
    """Deterministic (see :func:`ready_event_id`), so consumers can de-duplicate."""
    request_id: RequestId
    shard: RelativePath
    """Shard file, relative to the dataset root."""
    tensors: TensorNames
    num_tokens: PositiveInt
    layer_ids: list[NonNegativeInt]
    dtype: DType
    hidden_size: PositiveInt
    model: str
    checksum: Checksum
    """Of the hidden states' raw bytes as the extractor sent them: what a lossless
    codec decodes back to (fp8 decodes to dequantized values instead). Sent as
    fp8 (``hsx extract --wire-dtype fp8``): under a lossless codec, of the
    dequantized bytes stored; under ``fp8``/``fp8-zstd``, of the scales then
    codes as sent, which is the stored frame's own checksum."""
    codec: DatasetCodec = DatasetCodec.RAW
    """How the shard stores ``tensors.hidden_states``: ``raw``, the ``[T, L, H]``
    tensor of ``dtype`` itself; any other codec, a 1-D uint8 tensor of the
    encoded bytes (:mod:`hsx.schemas.dataset_codec`). Absent in events written before
    dataset codecs existed, which are all raw."""
    shape: tuple[PositiveInt, PositiveInt, PositiveInt] | None = None
    """The hidden states' ``[tokens, layers, hidden]``, which an encoded tensor no
    longer shows; absent in events written before dataset codecs existed."""
    metadata: dict[str, JsonValue] | None = None
    capture: Capture = "all"
    """``last``: ``hidden_states`` is ``[1, L, H]``, the final input token's only."""
    generation: GenerationRecord | None = None
    """How the answer was generated (token ranges, finish reasons, parameters,
    the final token), when the prompt asked for one."""
    source_request_id: str | None = Field(default=None, max_length=SOURCE_ID_CHARS)
    """The prompt's own id when ``request_id`` is its ``sample_id`` (an id no
    path or tensor name could take, e.g. ``HumanEval/0``)."""
    speculation: Speculation | None = None
    """A sample served with a draft (``hsx serve --draft``): which draft version,
    and what vLLM counted of its acceptance for that request."""


def ready_event_id(dataset: str, request_id: str) -> str:
    """The same sample in the same dataset always gets the same event id, however
    often it is replayed."""
    return hashlib.sha256(f"{dataset}\0{request_id}".encode()).hexdigest()[:32]


class ShardIndex(StrictModel):
    """``index/<shard>.json``: written atomically after its shard, listing the ready
    event of every sample in the shard. The dataset index is the union of these."""

    schema_version: Literal[1] = SCHEMA_VERSION
    shard: RelativePath
    topic: str
    partition: NonNegativeInt
    first_offset: NonNegativeInt
    events: list[HiddenStatesReady]
