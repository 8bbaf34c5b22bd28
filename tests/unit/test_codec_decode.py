"""The block decoder's fast path: records written by the earlier decoder's
release still decode, reused per-thread buffers never leak between calls or
threads, and a zstd plane of the wrong size is caught."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import zstandard

from hsx.codecs.block import checksum, decode_block, encode_block
from hsx.codecs.framing import CorruptBlock
from hsx.schemas import Codec, DType
from hsx.schemas.blocks import FRAME_PREFIX, MAGIC, BlockHeader, Segment

# A bfloat16 [2, 2, 8] byteplane-zstd record (low plane raw, high plane zstd) as the
# encoder before this decoder wrote it: the wire format did not change.
OLD_RECORD = bytes.fromhex(
    "48535842d50000007b22636f6465635f76657273696f6e223a312c22636f646563223a2262797465706c616e652d7a737464222c"
    "226474797065223a2262666c6f61743136222c227368617065223a5b322c322c385d2c22746f6b656e5f7374617274223a332c22"
    "746f6b656e5f656e64223a352c22636865636b73756d223a2263726333323a3763643761613062222c227365676d656e7473223a"
    "5b7b22656e636f64696e67223a22726177222c226e6279746573223a33327d2c7b22656e636f64696e67223a227a737464222c22"
    "6e6279746573223a32377d5d7d200aeac09555002a2a005595c0ea0a20354a607585909aa5b0bac5d0dae5f0fa28b52ffd202095"
    "000058c0c0bfbe3e3f3f3f3f3f40020060380b86"
)
OLD_RAW = bytes.fromhex(
    "20c00ac0eabfc0bf95bf55bf00bf2abe2a3e003f553f953fc03fea3f0a40204035404a4060407540854090409a40a540b040ba40"
    "c540d040da40e540f040fa40"
)


def test_a_record_from_before_still_decodes() -> None:
    header, raw = decode_block(OLD_RECORD)
    assert raw == OLD_RAW
    assert (header.shape, header.token_start, [s.encoding for s in header.segments]) == ((2, 2, 8), 3, ["raw", "zstd"])


def _random_block(seed: int, tokens: int, dtype: DType) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.integers(0, 256, size=tokens * 4 * 32 * dtype.itemsize, dtype=np.uint8)


@pytest.mark.parametrize("dtype", list(DType))
def test_a_smaller_block_after_a_larger_one_is_not_polluted(dtype: DType) -> None:
    big, small = _random_block(1, 300, dtype), _random_block(2, 3, dtype)
    for raw, tokens in ((big, 300), (small, 3), (big, 300)):
        _, out = decode_block(encode_block(raw, shape=(tokens, 4, 32), dtype=dtype, token_start=0))
        assert out == raw.tobytes()


def test_threads_decode_side_by_side() -> None:
    raws = [_random_block(seed, 50 + seed, DType.BFLOAT16) for seed in range(16)]
    values = [encode_block(r, shape=(50 + i, 4, 32), dtype=DType.BFLOAT16, token_start=0) for i, r in enumerate(raws)]
    with ThreadPoolExecutor(4) as pool:
        for _ in range(5):
            assert [raw for _, raw in pool.map(decode_block, values)] == [r.tobytes() for r in raws]


def _record(planes: list[bytes], raw: bytes) -> bytes:
    header = BlockHeader(codec=Codec.BYTEPLANE_ZSTD, dtype=DType.BFLOAT16, shape=(1, 1, len(raw) // 2),
                         token_start=0, token_end=1, checksum=checksum(raw),
                         segments=[Segment(encoding="zstd", nbytes=len(p)) for p in planes])
    header_bytes = header.model_dump_json().encode()
    return b"".join([FRAME_PREFIX.pack(MAGIC, len(header_bytes)), header_bytes, *planes])


@pytest.mark.parametrize("plane_bytes, message", [(9, "holds more than 8 bytes"), (7, "holds 7 bytes")])
def test_a_zstd_plane_of_the_wrong_size_is_detected(plane_bytes: int, message: str) -> None:
    raw = bytes(range(16))
    compress = zstandard.ZstdCompressor().compress
    planes = [compress(raw[0::2]), compress(bytes(range(plane_bytes)))]
    with pytest.raises(CorruptBlock, match=message):
        decode_block(_record(planes, raw))
