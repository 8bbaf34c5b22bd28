"""The metadata in each shard's safetensors header, so a shard file describes
itself without its index (``hsx.schemas.ShardIndex``, written beside it), and the
dataset's record of the blocks topic it was written from (:class:`TopicRecord`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Literal

import orjson

from hsx.schemas.blocks import DType, PositiveInt
from hsx.schemas.common import SCHEMA_VERSION, NonNegativeInt, RequestId, StrictModel
from hsx.schemas.dataset_codec import DatasetCodec

# safetensors metadata is a flat map of strings: these fields are stored as they
# are, every other one as JSON, so any safetensors reader can parse each value.
_TEXT_FIELDS = frozenset({"model", "dtype", "codec"})


class ShardMetadata(StrictModel):
    """The metadata in a shard's safetensors header: what all of its samples share
    (a shard holds samples of one model, layer set, dtype and width) and which
    samples it holds, so the file describes itself without its index."""

    schema_version: Literal[1] = SCHEMA_VERSION
    model: str
    layer_ids: list[NonNegativeInt]
    dtype: DType
    hidden_size: PositiveInt
    request_ids: list[RequestId]
    codec: DatasetCodec = DatasetCodec.RAW
    """How every sample's ``hidden_states`` tensor is stored (see
    ``HiddenStatesReady.codec``); a shard written before codecs has none: raw."""

    def to_safetensors(self) -> dict[str, str]:
        """As the ``metadata`` argument of ``safetensors.torch.save_file``."""
        return {
            name: value if name in _TEXT_FIELDS else orjson.dumps(value).decode()
            for name, value in self.model_dump(mode="json").items()
        }

    @classmethod
    def from_safetensors(cls, metadata: Mapping[str, str]) -> ShardMetadata:
        """Parse what :meth:`to_safetensors` wrote (``safe_open(...).metadata()``);
        raises ``ValueError`` when a value is not what the contract says."""
        decoded = {name: value if name in _TEXT_FIELDS else orjson.loads(value) for name, value in metadata.items()}
        try:
            document = orjson.dumps(decoded)
        except orjson.JSONEncodeError as exc:  # a TypeError: nested deeper than orjson writes
            raise ValueError(f"shard metadata: {exc}") from None
        # Validated from JSON so that strict mode still accepts dtype as its string.
        return cls.model_validate_json(document)



class TopicRecord(StrictModel):
    """``topics/<topic>.json`` in a dataset: the partition count of the blocks
    topic its shards were written from. Dedupe is per partition (a request's
    records share its key, hence its partition), which holds only while the
    count stays the same; the sink refuses a topic whose count differs."""

    schema_version: Literal[1] = SCHEMA_VERSION
    topic: str
    partitions: PositiveInt
