"""What the connector sends for one request attempt: its hidden states cut into
block records of whole tokens, and the manifest that lists them (wire contracts:
:mod:`hsx.schemas.blocks`, :class:`hsx.schemas.Manifest`). Pure functions: the
:class:`~hsx.extractor.connector.sender.BlockSender` decides when and in what order."""

from __future__ import annotations

from typing import Any

import torch

from hsx.codecs.block import encode_block_record
from hsx.codecs.framing import Record
from hsx.codecs.fp8_blocks import encode_fp8_record
from hsx.extractor.connector.gather import Gathered
from hsx.extractor.connector.metadata import SendJob, answer_fields
from hsx.runtime.tensors import WIRE_DTYPES
from hsx.schemas import BlockRef, Manifest
from hsx.schemas.connector import ConnectorConfig, RequestParams


def block_ranges(gathered: Gathered, block_bytes: int) -> list[tuple[int, int]]:
    """Token ranges ``[start, end)`` of the blocks: as many whole tokens as fit
    ``block_bytes`` of what is sent (fp8: a code per element and a float32 scale
    per layer), at least one."""
    tokens, layers, hidden = gathered.tensor.shape
    row_bytes = layers * hidden * gathered.tensor.element_size() + (
        0 if gathered.scales is None else layers * gathered.scales.element_size())
    per_block = max(1, block_bytes // row_bytes)
    return [(start, min(start + per_block, tokens)) for start in range(0, tokens, per_block)]


def raw_bytes(gathered: Gathered) -> int:
    """The hidden states' size in the model's dtype, however they are sent: the
    in-flight budget's and the statistics' measure."""
    tokens, layers, hidden = gathered.tensor.shape
    return tokens * layers * hidden * gathered.source_dtype.itemsize


def encode_rows(gathered: Gathered, start: int, end: int, token_start: int, config: ConnectorConfig) -> Record:
    """Block record of rows ``[start, end)``, compressed with ``config``'s codec:
    as pieces by reference (written one by one to the staged object), joined
    inline (a Kafka record's value); waits for the device-to-host copy. Raises
    ``ValueError`` for fp8 rows whose scale is not finite."""
    rows = gathered.wait()[start:end]
    shape: tuple[int, int, int] = tuple(rows.shape)  # type: ignore[assignment]
    dtype = WIRE_DTYPES[gathered.source_dtype]
    if gathered.scales is None:
        return encode_block_record(rows.view(torch.uint8).numpy(), shape=shape, dtype=dtype, token_start=token_start,
                                   codec=config.codec, level=config.codec_level, joined=config.payload_store is None)
    scales = gathered.scales[start:end]
    if not bool(torch.isfinite(scales).all()):  # a row's amax was inf or NaN
        raise ValueError("fp8 cannot hold non-finite hidden states (E4M3FN has no infinities); "
                         "extract this model with --wire-dtype model")
    return encode_fp8_record(rows.numpy(), scales.numpy(), shape=shape, dtype=dtype, token_start=token_start,
                             codec=config.codec, level=config.codec_level, joined=config.payload_store is None)


def block_ref(index: int, record: Record) -> BlockRef:
    """What the manifest says of block ``index``, encoded as ``record``."""
    header = record.header
    return BlockRef(index=index, token_start=header.token_start, token_end=header.token_end,
                    checksum=header.checksum, compressed_nbytes=record.nbytes)


def manifest_record(job: SendJob, params: RequestParams, gathered: Gathered, refs: list[BlockRef],
                    config: ConnectorConfig, layer_ids: list[int]) -> bytes:
    """The manifest of an attempt whose blocks are ``refs``, in order; by
    reference (``config.payload_store``) it says where they are in the staged
    object. Raises ``ValueError`` when it fails its own checks."""
    manifest = Manifest(
        request_id=params.request_id,
        attempt_id=params.attempt_id,
        model=config.model,
        layer_ids=layer_ids,
        dtype=WIRE_DTYPES[gathered.source_dtype],
        hidden_size=gathered.tensor.shape[2],
        num_tokens=len(job.token_ids),
        token_ids=job.token_ids,
        **answer_fields(job, params),
        codec=config.codec,
        quantization="fp8" if gathered.scales is not None else None,
        blocks=refs,
        metadata=params.metadata,
        source=params.source,
        speculation=params.speculation,
    )
    if config.payload_store is not None:
        manifest = manifest.by_reference()
    # Fields a manifest does not use are left out, as before they existed (older sinks forbid unknown fields).
    unused: dict[str, Any] = {} if manifest.quantization else {"quantization": True}
    if manifest.speculation is None:
        unused["speculation"] = True
    if manifest.payload is None:
        unused |= {"payload": True, "blocks": {"__all__": {"offset"}}}
    return manifest.model_dump_json(exclude=unused).encode()
