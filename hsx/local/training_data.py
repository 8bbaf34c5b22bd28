"""Training datasets built without an engine, through the sink's own write path
(:func:`hsx.dataset.shards.write_shard`, the same tensors, index and ready events an
engine run gives): for the trainer tests and the loader benchmark.

Samples alternate between chats (a loss mask on their second half), plain texts
(no stored mask), and, when asked, chats without a supervised token.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from pathlib import Path

import torch

from hsx.codecs.block import checksum
from hsx.dataset.encoding import encode
from hsx.dataset.sample import Sample
from hsx.dataset.shards import OpenShard, write_shard
from hsx.dataset.storage import LocalStorage, Storage
from hsx.runtime.tensors import TORCH_DTYPES
from hsx.schemas import BlockRef, Codec, DType, HiddenStatesReady, Manifest, SourceRef
from hsx.schemas.dataset_codec import DatasetCodec


@dataclass
class TrainingDataSpec:
    """The shape of a synthetic dataset. Defaults: small and fast for tests."""

    samples: int = 24
    min_tokens: int = 3
    max_tokens: int = 40
    layer_ids: tuple[int, ...] = (1, 2, 3, 4)
    hidden_size: int = 16
    dtype: DType = DType.FLOAT32
    vocab: int = 97
    per_shard: int = 5
    unsupervised_every: int = 0
    """Every k-th sample is a chat whose mask is all zero (0: none)."""
    model: str = "synthetic-llama"
    seed: int = 0
    codec: DatasetCodec = DatasetCodec.RAW
    """How the shards store hidden states (``hsx sink --dataset-codec``)."""


def _sample(spec: TrainingDataSpec, i: int, gen: torch.Generator) -> Sample:
    tokens = int(torch.randint(spec.min_tokens, spec.max_tokens + 1, (1,), generator=gen))
    hidden = torch.randn(tokens, len(spec.layer_ids), spec.hidden_size, generator=gen).to(TORCH_DTYPES[spec.dtype])
    raw = hidden.contiguous().view(torch.uint8).numpy().tobytes()
    if spec.unsupervised_every and i % spec.unsupervised_every == spec.unsupervised_every - 1:
        spans: list[tuple[int, int]] | None = []
    elif i % 2 == 0:
        spans = [(tokens // 2, tokens)]
    else:
        spans = None  # plain text
    manifest = Manifest(
        request_id=f"s-{i:05d}", attempt_id=uuid.UUID(int=i).hex, model=spec.model, layer_ids=list(spec.layer_ids),
        dtype=spec.dtype, hidden_size=spec.hidden_size, num_tokens=tokens,
        token_ids=torch.randint(0, spec.vocab, (tokens,), generator=gen).tolist(), loss_mask_spans=spans,
        codec=Codec.NONE, metadata={"i": i},
        blocks=[BlockRef(index=0, token_start=0, token_end=tokens, checksum=checksum(raw), compressed_nbytes=len(raw))],
        source=SourceRef(topic="prompts", partition=0, offset=i))
    return Sample(manifest, raw, [i])


def write_training_dataset(root: Path | Storage, spec: TrainingDataSpec | None = None, partitions: int = 1,
                           dataset: str = "synthetic") -> list[HiddenStatesReady]:
    """Write ``spec.samples`` samples to ``root`` (a directory or any storage; sample i to partition
    ``i % partitions``, ``per_shard`` to a shard); return their ready events in
    the order written."""
    spec = spec or TrainingDataSpec()
    gen = torch.Generator().manual_seed(spec.seed)
    storage = LocalStorage(root) if isinstance(root, Path) else root
    open_shards = [OpenShard("hidden_states.blocks", p) for p in range(partitions)]
    events: list[HiddenStatesReady] = []
    for i in range(spec.samples):
        shard = open_shards[i % partitions]
        shard.add(encode(_sample(spec, i, gen), spec.codec))
        if len(shard.samples) == spec.per_shard or i >= spec.samples - partitions:
            events += write_shard(storage, dataset, shard)
            open_shards[i % partitions] = OpenShard("hidden_states.blocks", i % partitions)
    return events
