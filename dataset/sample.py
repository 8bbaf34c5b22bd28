"""A verified sample, the unit a dataset stores: the sink's assembler builds it
from block records, the dataset's encoding and shard writer store it."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from typing_extensions import Buffer

from hsx.schemas import Manifest
from hsx.schemas.dataset_codec import DatasetCodec


@dataclass(frozen=True)
class FileRange:
    """Bytes a sample stores that stay in a local file until its shard is
    written, which copies them from there (:func:`hsx.dataset.file_copy.copy_range`):
    a staged object in a directory, verified when it was read, and not deleted
    before the sample is durable."""

    path: Path
    offset: int
    length: int
    dtype: str = "U8"
    """Its safetensors dtype: ``U8`` for encoded bytes, the model's for a raw sample."""
    shape: tuple[int, ...] | None = None
    """Its shape; None: 1-D, ``length`` elements."""

    def __len__(self) -> int:
        return self.length


@dataclass(frozen=True)
class Pieces:
    """Bytes a sample stores as pieces that its shard writes one after another
    (block records as they came, each a Kafka record's value), never joined into
    one buffer."""

    parts: tuple[Buffer, ...]
    nbytes: int

    @classmethod
    def of(cls, parts: list[Buffer]) -> Pieces:
        return cls(tuple(parts), sum(memoryview(part).nbytes for part in parts))

    def __len__(self) -> int:
        return self.nbytes

    def __bytes__(self) -> bytes:
        return b"".join(self.parts)


@dataclass
class Sample:
    """A verified sample: its manifest and the raw bytes of ``[T, L, H]``, or,
    once :func:`hsx.dataset.encoding.encode` ran, the bytes its shard stores."""

    manifest: Manifest
    hidden_states: bytes | memoryview | Pieces | FileRange
    offsets: list[int]
    """Offsets of all its records (blocks and manifest) in the partition."""
    records: list[Buffer] = field(default_factory=list)
    """Its block records in manifest order, each verified: ``byteplane-zstd``
    keeps them instead of encoding again. Dropped once encoded."""
    codec: DatasetCodec = DatasetCodec.RAW
    """How ``hidden_states`` is encoded."""
    checksum: str | None = None
    """Of the raw bytes: known from the blocks' own when they were verified, and
    kept when ``hidden_states`` no longer holds them; None: computed from them."""
    fp8: tuple[np.ndarray, np.ndarray] | None = None
    """A sample sent as fp8 (its manifest's ``quantization``): its verified
    ``(codes [T, L, H] uint8, scales [T, L] float32)`` as the extractor sent them;
    ``hidden_states`` is then empty until :func:`hsx.dataset.encoding.encode` stores them."""

    @property
    def manifest_offset(self) -> int:
        return self.offsets[-1]

    @property
    def held_bytes(self) -> int:
        """The bytes of it this process holds in memory."""
        return 0 if isinstance(self.hidden_states, FileRange) else len(self.hidden_states)
