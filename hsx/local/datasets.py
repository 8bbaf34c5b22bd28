"""Datasets built without an engine or a broker, through the sink's own write
path (:func:`hsx.dataset.shards.write_shard`): for the sink's scale benchmark and the
dedupe tests, which need many stored samples quickly."""

from __future__ import annotations

import numpy as np

from hsx.codecs.block import checksum
from hsx.dataset.sample import Sample
from hsx.dataset.shards import OpenShard, write_shard
from hsx.dataset.storage import Storage
from hsx.schemas import BlockRef, Codec, DType, Manifest, SourceRef

HIDDEN = 8
_ROW = np.arange(HIDDEN, dtype=np.float32).tobytes()
_TEMPLATE = Manifest(
    request_id="template", attempt_id="0" * 32, model="tiny", layer_ids=[0], dtype=DType.FLOAT32,
    hidden_size=HIDDEN, num_tokens=1, token_ids=[0], codec=Codec.NONE,
    blocks=[BlockRef(index=0, token_start=0, token_end=1, checksum=checksum(_ROW), compressed_nbytes=len(_ROW))],
    source=SourceRef(topic="prompts", partition=0, offset=0))


def tiny_sample(request_id: str, offset: int, token_id: int = 0) -> Sample:
    """A verified-looking sample of 1 token × 1 layer × 8 hidden whose manifest
    record sits at ``offset``. ``token_id`` tells prompts apart (a conflicting
    duplicate has another)."""
    # model_copy skips validation: the template was validated, and the fields set here keep it valid.
    manifest = _TEMPLATE.model_copy(update={"request_id": request_id, "token_ids": [token_id]})
    # Bytes of its own: safetensors refuses tensors that share memory.
    return Sample(manifest, bytearray(_ROW), [offset])


def write_tiny_dataset(storage: Storage, topic: str, partition: int, request_ids: list[str],
                       per_shard: int = 10_000, first_offset: int = 0, dataset: str = "tiny") -> int:
    """Store one tiny sample per request id, ``per_shard`` to a shard, their
    manifests at consecutive offsets from ``first_offset``, as the sink would;
    returns the next free offset."""
    offset = first_offset
    for start in range(0, len(request_ids), per_shard):
        shard = OpenShard(topic, partition)
        for request_id in request_ids[start:start + per_shard]:
            shard.add(tiny_sample(request_id, offset))
            offset += 1
        write_shard(storage, dataset, shard)
    return offset
