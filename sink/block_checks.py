"""The checks a manifest's blocks pass before they are a sample (the
assembler's, for block records and staged objects alike): every listed block
present and its header agreeing with the manifest, then its bytes verified:
decoded into the sample's one buffer, verified as stored (kept as they came),
or decoded to fp8 codes and scales. A failed check raises
:class:`~hsx.runtime.errors.InvalidInput` with the error class its dead letter
carries."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
from typing_extensions import Buffer

from hsx.codecs.block import combined_checksum, decode_block, read_header, verify_stored
from hsx.codecs.framing import CorruptBlock
from hsx.codecs.fp8_blocks import fp8_rows
from hsx.runtime.errors import InvalidInput
from hsx.schemas import BlockHeader, ErrorClass, Manifest


def check_headers(manifest: Manifest, blocks: dict[int, Buffer]) -> list[BlockHeader]:
    """Every block the manifest lists is there, and its header agrees with it;
    the headers in the manifest's order."""
    missing = [b.index for b in manifest.blocks if b.index not in blocks]
    if missing:
        raise InvalidInput(ErrorClass.INCOMPLETE_SAMPLE, f"manifest lists blocks {missing} that never arrived")
    extra = sorted(set(blocks) - {b.index for b in manifest.blocks})
    if extra:
        raise InvalidInput(ErrorClass.INCOMPLETE_SAMPLE, f"blocks {extra} are not in the manifest")
    headers = []
    for ref in manifest.blocks:
        with corrupt_block(ref.index):
            header, _ = read_header(blocks[ref.index])
        headers.append(header)
        expected_shape = (ref.token_end - ref.token_start, len(manifest.layer_ids), manifest.hidden_size)
        if (header.token_start, header.token_end, header.checksum) != (ref.token_start, ref.token_end, ref.checksum):
            raise InvalidInput(ErrorClass.CORRUPT_BLOCK, f"block {ref.index} does not match the manifest's token range or checksum")
        if header.shape != expected_shape or header.dtype is not manifest.dtype:
            raise InvalidInput(ErrorClass.SHAPE_MISMATCH, f"block {ref.index} is {header.shape} {header.dtype.value}, "
                                             f"the manifest says {expected_shape} {manifest.dtype.value}")
        if header.quantization != manifest.quantization:
            raise InvalidInput(ErrorClass.CORRUPT_BLOCK, f"block {ref.index} holds {header.quantization or 'unquantized'} "
                                                      f"rows, the manifest says {manifest.quantization or 'unquantized'}")
    return headers


def decoded(manifest: Manifest, records: list[Buffer], headers: list[BlockHeader]) -> tuple[bytearray, str]:
    """The sample's raw bytes, each block decoded (its checksum verified) straight
    into its rows of one buffer, and their checksum: the blocks' combined, which
    the decode just proved (the shard needs it; no second pass over the bytes).
    Allocated once every header agreed with the manifest (``headers``: the
    records', as read, not parsed again), so its size is what the blocks claim."""
    row = len(manifest.layer_ids) * manifest.hidden_size * manifest.dtype.itemsize
    raw = bytearray(manifest.captured_tokens * row)
    rows = memoryview(raw)
    first = manifest.first_captured
    for ref, record, header in zip(manifest.blocks, records, headers):
        with corrupt_block(ref.index):
            decode_block(record, out=rows[(ref.token_start - first) * row:(ref.token_end - first) * row],
                         header=header)
    return raw, combined_checksum(headers)


def verified(manifest: Manifest, records: list[Buffer], headers: list[BlockHeader]) -> str:
    """Verify each block as stored (its payload checksum; a block written before
    those is decoded into a reused buffer); the checksum of the sample's raw
    bytes, combined from the blocks'. ``headers``: the records', as read."""
    for ref, record, header in zip(manifest.blocks, records, headers):
        with corrupt_block(ref.index):
            verify_stored(record, header)
    return combined_checksum(headers)


def fp8_decoded(manifest: Manifest, records: list[Buffer]) -> tuple[np.ndarray, np.ndarray]:
    """An fp8 sample's codes ``[T, L, H]`` and scales ``[T, L]``, its blocks' back to back."""
    parts = []
    for ref, record in zip(manifest.blocks, records):
        with corrupt_block(ref.index):
            parts.append(fp8_rows(*decode_block(record)))
    if len(parts) == 1:
        return parts[0]
    return np.concatenate([codes for codes, _ in parts]), np.concatenate([scales for _, scales in parts])


@contextmanager
def corrupt_block(index: int) -> Iterator[None]:
    """A :class:`CorruptBlock` inside is block ``index``'s ``corrupt_block``."""
    try:
        yield
    except CorruptBlock as exc:
        raise InvalidInput(ErrorClass.CORRUPT_BLOCK, f"block {index}: {exc}") from exc
