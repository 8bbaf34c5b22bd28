"""Classes of defects that fuzzing the wire parsers found (``tests/fuzz``; each
input is kept in ``tests/fuzz/regressions``): a bad record gets an error of a
documented class, and nothing is sized from a declared length before that
length is checked."""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest
from pydantic import ValidationError

from hsx.codecs.block import encode_block
from hsx.codecs.framing import CorruptBlock, frame
from hsx.codecs.dataset import decode_sample
from hsx.schemas import DlqHeaders, DType
from hsx.schemas.blocks import MAGIC, BlockHeader, Codec, Segment
from hsx.schemas.dataset_codec import DatasetCodec


def test_dlq_headers_that_are_not_utf8_fail_validation_not_decoding() -> None:
    kafka = [("hsx-error-class", b"invalid_json"), ("hsx-error-message", b"bad \xff\xfe"), ("hsx-service", b"producer")]
    assert DlqHeaders.from_kafka(kafka).error_message == "bad \ufffd\ufffd"
    with pytest.raises(ValidationError, match="source_offset"):
        DlqHeaders.from_kafka([*kafka, ("hsx-source-offset", b"\xff")])


def test_a_raw_sample_whose_shape_overflows_int64_is_refused() -> None:
    # 2**31 * 2**31 * 4 elements: numpy's product wrapped to 0, which an empty payload matched.
    with pytest.raises(CorruptBlock, match="raw sample of 0 bytes"):
        decode_sample(b"", shape=(2**31, 2**31, 4), dtype=DType.FLOAT32, codec=DatasetCodec.RAW)


@pytest.mark.parametrize("declared", [(1, 1, 2**24), (2, 1, 16)], ids=["wider", "more tokens"])
def test_a_byteplane_record_is_checked_against_the_sample_before_it_is_decoded(declared: tuple[int, int, int]) -> None:
    """A record whose header declares more than the sample's shape (from its index
    entry) holds is refused before any buffer is sized from that header."""
    planes = 4
    per_plane = max(1, declared[0] * declared[1] * declared[2] // 32768)  # just enough for the zstd ratio check
    header = BlockHeader(codec=Codec.BYTEPLANE_ZSTD, dtype=DType.FLOAT32, shape=declared, token_start=0,
                         token_end=declared[0], checksum="crc32:00000000",
                         segments=[Segment(encoding="zstd", nbytes=per_plane)] * planes)
    record = frame(MAGIC, header, [(b"\x28\xb5\x2f\xfd" + bytes(per_plane))[:per_plane]] * planes)
    tracemalloc.start()
    try:
        with pytest.raises(CorruptBlock, match="expected tokens from 0 up to 1 of"):
            decode_sample(np.frombuffer(record, dtype=np.uint8), shape=(1, 1, 16), dtype=DType.FLOAT32,
                          codec=DatasetCodec.BYTEPLANE_ZSTD)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20


def test_a_byteplane_sample_of_records_that_fit_still_decodes() -> None:
    raw = np.arange(2 * 1 * 16, dtype="<f4").tobytes()
    records = [encode_block(raw[i * 64 : (i + 1) * 64], shape=(1, 1, 16), dtype=DType.FLOAT32, token_start=i)
               for i in range(2)]
    assert decode_sample(b"".join(records), shape=(2, 1, 16), dtype=DType.FLOAT32,
                         codec=DatasetCodec.BYTEPLANE_ZSTD) == raw
