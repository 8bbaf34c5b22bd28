"""The block decoder as it was before issue 16, kept only so that
``bench.dataset_codecs`` can time it beside :func:`hsx.codecs.block.decode_block` in
one process: a fresh ``bytes`` per plane, ``np.stack`` along axis 1, ``tobytes``.
The framing and checks are the current ones; only the per-plane work differs."""

from __future__ import annotations

import numpy as np
import zstandard
from typing_extensions import Buffer

from hsx.codecs.block import CorruptBlock, checksum, read_header
from hsx.schemas.blocks import Codec

_decompressor = zstandard.ZstdDecompressor()


def decode_block(value: Buffer) -> bytes:
    """The raw bytes of a block record, decoded the old way."""
    header, payload = read_header(value)
    planes_count = header.dtype.itemsize if header.codec is Codec.BYTEPLANE_ZSTD else 1
    size = header.raw_nbytes // planes_count
    planes, offset = [], 0
    for segment in header.segments:
        chunk = payload[offset : offset + segment.nbytes]
        offset += segment.nbytes
        planes.append(bytes(chunk) if segment.encoding == "raw"
                      else _decompressor.decompress(chunk, max_output_size=size))
    if header.codec is Codec.BYTEPLANE_ZSTD:
        raw = np.stack([np.frombuffer(p, dtype=np.uint8) for p in planes], axis=1).tobytes()
    else:
        raw = planes[0]
    if checksum(raw) != header.checksum:
        raise CorruptBlock("checksum mismatch")
    return raw
