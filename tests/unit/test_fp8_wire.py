"""fp8 block records (``hsx extract --wire-dtype fp8``): the connector's gather
quantizes to exactly :func:`hsx.codecs.fp8.to_fp8`'s codes and scales, the record
carries them bit for bit under every block codec, version 1 records are
unchanged, and the sink rejects a malformed fp8 block with a reason, stores fp8
codes as they came, or dequantizes them within the documented bound."""

from __future__ import annotations

import uuid

import numpy as np
import orjson
import pytest
import torch

from hsx.codecs.block import decode_block, encode_block, read_header
from hsx.codecs.framing import CorruptBlock, frame
from hsx.codecs.dataset import decode_sample, read_fp8
from hsx.codecs.fp8 import from_fp8, to_fp8, widen
from hsx.codecs.fp8_blocks import encode_fp8_block, encode_fp8_record, fp8_rows, quantize_block
from hsx.dataset.encoding import encode
from hsx.dataset.sample import Sample
from hsx.extractor.connector.gather import gather_cpu
from hsx.runtime.tensors import TORCH_DTYPES, WIRE_DTYPES
from hsx.schemas import BlockRecordHeaders, BlockRef, Codec, DType, ErrorClass, Manifest, RecordKind, SourceRef
from hsx.schemas.blocks import MAGIC
from hsx.schemas.dataset_codec import DatasetCodec
from hsx.sink.assembler import Assembler, Record, RejectedRecords
from tests.unit.test_dataset_storage import assert_decoded

LAYERS, HIDDEN, BLOCK = 3, 64, 16


def _cache(dtype: torch.dtype, seed: int) -> torch.Tensor:
    """A paged cache ``[blocks, layers, slots, hidden]`` of hidden-state-like
    values (outlier channels, a spread of row norms) with all-zero rows."""
    generator = torch.Generator().manual_seed(seed)
    cache = torch.randn(12, LAYERS, BLOCK, HIDDEN, generator=generator)
    cache *= torch.exp(torch.randn(12, LAYERS, BLOCK, 1, generator=generator) * 3)
    cache[..., 5] *= 40  # an outlier channel
    cache[3, :, 7] = 0  # a whole token's rows are zero
    cache[4, 1, 2] = 0  # one layer's row of another token
    cache[5, 0, 0, :10] = torch.tensor([1e-30, -1e-39, 2.0**-140, 0, 0, 0, 0, 0, 0, 0])  # tiny, subnormal
    return cache.to(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("seed", range(3))
def test_cpu_gather_quantizes_as_numpy_bit_for_bit(dtype: torch.dtype, seed: int) -> None:
    cache = _cache(dtype, seed)
    block_ids, tokens = [3, 9, 4, 5, 0], 70
    rows = gather_cpu(cache, block_ids, tokens, BLOCK).tensor
    gathered = gather_cpu(cache, block_ids, tokens, BLOCK, fp8=True)
    assert gathered.tensor.dtype == torch.uint8 and gathered.source_dtype == dtype
    codes, scales = to_fp8(widen(rows.contiguous().view(torch.uint8).numpy(), (tokens, LAYERS, HIDDEN),
                                 WIRE_DTYPES[dtype]))
    assert np.array_equal(gathered.tensor.numpy(), codes)
    assert gathered.scales is not None
    assert np.array_equal(gathered.scales.numpy().view(np.uint32), scales.view(np.uint32))
    assert (codes[7 - 0, :] == 0).all() and scales[7].tolist() == [2.0**-126] * LAYERS  # the zero token


@pytest.mark.parametrize("codec", list(Codec))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_an_fp8_record_round_trips_bit_exact(codec: Codec, dtype: torch.dtype) -> None:
    gathered = gather_cpu(_cache(dtype, 7), [3, 1, 2], 40, BLOCK, first=2, fp8=True)
    codes, scales = gathered.tensor.numpy(), gathered.scales.numpy()  # type: ignore[union-attr]
    value = encode_fp8_block(codes, scales, shape=codes.shape, dtype=WIRE_DTYPES[dtype], token_start=2, codec=codec)
    record = encode_fp8_record(codes.copy(), scales.copy(), shape=codes.shape, dtype=WIRE_DTYPES[dtype],
                               token_start=2, codec=codec)
    header, raw = decode_block(value)
    assert record.value() == value and record.header == header  # the connector's pieces are the same record
    assert (header.codec_version, header.quantization, header.dtype, header.codec) == (2, "fp8", WIRE_DTYPES[dtype], codec)
    assert (header.token_start, header.token_end, header.shape) == (2, 40, (38, LAYERS, HIDDEN))
    got_codes, got_scales = fp8_rows(header, raw)
    assert np.array_equal(got_codes, codes) and np.array_equal(got_scales.view(np.uint32), scales.view(np.uint32))
    rows = gather_cpu(_cache(dtype, 7), [3, 1, 2], 40, BLOCK, first=2).tensor
    plain = encode_block(rows.view(torch.uint8).numpy(), shape=tuple(rows.shape), dtype=WIRE_DTYPES[dtype],
                         token_start=2, codec=Codec.NONE)
    assert len(value) < 0.55 * len(plain) if dtype == torch.bfloat16 else 0.3 * len(plain)  # before compression


def test_version_1_records_are_written_exactly_as_before() -> None:
    """No ``quantization`` key in a version 1 header, so sinks older than fp8
    blocks still read what a new extractor sends by default."""
    raw = torch.randn(4, 2, 8).to(torch.bfloat16).view(torch.uint8).numpy()
    header, _ = read_header(encode_block(raw, shape=(4, 2, 8), dtype=DType.BFLOAT16, token_start=0))
    value = encode_block(raw, shape=(4, 2, 8), dtype=DType.BFLOAT16, token_start=0)
    length = int.from_bytes(value[4:8], "little")
    assert "quantization" not in orjson.loads(value[8 : 8 + length]) and header.codec_version == 1


def _fp8_value(tokens: int = 6, start: int = 0, codec: Codec = Codec.ZSTD) -> tuple[bytes, np.ndarray, np.ndarray]:
    values = np.random.default_rng(tokens).normal(size=(tokens, LAYERS, HIDDEN)).astype(np.float32)
    codes, scales = to_fp8(values)
    return encode_fp8_block(codes, scales, shape=codes.shape, dtype=DType.FLOAT32, token_start=start,
                            codec=codec), codes, scales


def _reframed(value: bytes, codes: np.ndarray, scales: np.ndarray, **changes: object) -> bytes:
    """A record with a valid CRC over different codes/scales: what a buggy sender might send."""
    header, _ = read_header(value)
    parts = [np.ascontiguousarray(scales, dtype="<f4").tobytes(), np.ascontiguousarray(codes).tobytes()]
    from hsx.codecs.block import checksum
    from hsx.schemas.blocks import Segment

    changed = header.model_copy(update={"checksum": checksum(*parts), "codec": Codec.NONE, **changes,
                                        "segments": [Segment(encoding="raw", nbytes=len(p)) for p in parts]})
    return frame(MAGIC, changed, parts)


def _corruptions() -> dict[str, tuple[bytes, str]]:
    value, codes, scales = _fp8_value()
    nan_codes = codes.copy()
    nan_codes[2, 1, 5] = 0x7F
    short = codes.copy()
    short[4, 2] = 0x30  # the row's largest code is not 448 although its scale is above the floor
    body = bytearray(value)
    body[-3] ^= 0x40
    header, payload = read_header(value)
    return {
        "crc": (bytes(body), "checksum mismatch|does not decompress|holds"),
        "nan": (_reframed(value, nan_codes, scales), "malformed fp8 row at token 2, layer 1"),
        "scale": (_reframed(value, short, scales), "malformed fp8 row at token 4, layer 2"),
        "negative": (_reframed(value, codes, -scales), "malformed fp8 row at token 0, layer 0"),
        "truncated": (value[:-10], "payload is"),
        "one-segment": (frame(MAGIC, header.model_copy(update={"segments": header.segments[:1]}),
                              [payload[: header.segments[0].nbytes]]), "block has 1 segments, its header's codec needs 2"),
    }


@pytest.mark.parametrize("case", ["crc", "nan", "scale", "negative", "truncated", "one-segment"])
def test_a_malformed_fp8_block_is_refused_with_a_reason(case: str) -> None:
    value, expected = _corruptions()[case]
    with pytest.raises(CorruptBlock, match=expected):
        fp8_rows(*decode_block(value))


def test_version_and_quantization_go_together() -> None:
    value, _, _ = _fp8_value()
    header, _ = read_header(value)
    with pytest.raises(ValueError, match="quantization is set on codec version 2"):
        type(header).model_validate({**header.model_dump(), "codec_version": 1})


# -- the sink ---------------------------------------------------------------------------


def fp8_records(request_id: str = "f-1", tokens: int = 11, per_block: int = 4, dtype: torch.dtype = torch.bfloat16,
                first_offset: int = 0, blocks: dict[int, bytes] | None = None) -> tuple[list[Record], torch.Tensor]:
    """The fp8 block records and manifest the connector sends (``--wire-dtype
    fp8``) for random rows of ``dtype``, which it returns; ``blocks`` replaces
    some block values (a corrupt one)."""
    attempt = uuid.uuid4().hex
    hidden = (torch.randn(tokens, LAYERS, HIDDEN) * 3).to(dtype)
    hidden[1] = 0
    out, refs = [], []
    for index, start in enumerate(range(0, tokens, per_block)):
        rows = hidden[start : start + per_block].contiguous()
        value = quantize_block(rows.view(torch.uint8).numpy(), shape=tuple(rows.shape), dtype=WIRE_DTYPES[dtype],
                               token_start=start)
        header, _ = read_header(value)
        refs.append(BlockRef(index=index, token_start=start, token_end=header.token_end, checksum=header.checksum,
                             compressed_nbytes=len(value)))
        value = (blocks or {}).get(index, value)
        headers = BlockRecordHeaders(kind=RecordKind.BLOCK, attempt_id=attempt, block_index=index, codec=Codec.BYTEPLANE_ZSTD)
        out.append(Record(first_offset + index, request_id.encode(), value, headers.to_kafka()))
    manifest = Manifest(request_id=request_id, attempt_id=attempt, model="m", layer_ids=[1, 2, 3],
                        dtype=WIRE_DTYPES[dtype], hidden_size=HIDDEN, num_tokens=tokens, token_ids=list(range(tokens)),
                        codec=Codec.BYTEPLANE_ZSTD, quantization="fp8", blocks=refs,
                        source=SourceRef(topic="p", partition=0, offset=1))
    out.append(Record(first_offset + len(refs), request_id.encode(), manifest.model_dump_json().encode(),
                      BlockRecordHeaders(kind=RecordKind.MANIFEST, attempt_id=attempt).to_kafka()))
    return out, hidden


def _assemble(recs: list[Record]) -> Sample | RejectedRecords:
    assembler = Assembler()
    (result,) = [r for r in map(assembler.add, recs) if r is not None]
    return result


def test_the_assembler_keeps_the_codes_the_extractor_sent() -> None:
    recs, hidden = fp8_records(tokens=11, per_block=4)
    sample = _assemble(recs)
    assert isinstance(sample, Sample) and sample.fp8 is not None and sample.hidden_states == b""
    codes, scales = to_fp8(hidden.float().numpy())
    assert np.array_equal(sample.fp8[0], codes) and np.array_equal(sample.fp8[1], scales)


@pytest.mark.parametrize("codec", [DatasetCodec.FP8, DatasetCodec.FP8_ZSTD])
def test_fp8_dataset_codecs_store_the_codes_as_sent(codec: DatasetCodec) -> None:
    recs, hidden = fp8_records()
    sample = _assemble(recs)
    assert isinstance(sample, Sample) and sample.fp8 is not None
    stored = encode(sample, codec)
    assert stored.codec is codec and stored.fp8 is None and stored.records == []
    codes, scales = read_fp8(stored.hidden_states, hidden.shape)  # type: ignore[arg-type]
    assert np.array_equal(codes, sample.fp8[0]) and np.array_equal(scales, sample.fp8[1])
    from hsx.codecs.block import checksum

    assert stored.checksum == checksum(scales.astype("<f4"), codes)  # the fp8 frame's own CRC
    assert_decoded(hidden, torch.frombuffer(bytearray(decode_sample(
        stored.hidden_states, shape=hidden.shape, dtype=DType.BFLOAT16, codec=codec)), dtype=torch.bfloat16)
        .view(hidden.shape), codec)  # type: ignore[arg-type]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("codec", [DatasetCodec.RAW, DatasetCodec.BYTEPLANE_ZSTD])
def test_other_dataset_codecs_get_it_dequantized_to_the_manifests_dtype(codec: DatasetCodec, dtype: torch.dtype) -> None:
    recs, hidden = fp8_records(dtype=dtype)
    sample = _assemble(recs)
    assert isinstance(sample, Sample) and sample.fp8 is not None
    stored = encode(sample, codec)
    raw = decode_sample(stored.hidden_states, shape=hidden.shape, dtype=WIRE_DTYPES[dtype], codec=codec)  # type: ignore[arg-type]
    decoded = torch.frombuffer(bytearray(raw), dtype=TORCH_DTYPES[WIRE_DTYPES[dtype]]).view(hidden.shape)
    expected = torch.from_numpy(from_fp8(*sample.fp8)).to(dtype)
    assert torch.equal(decoded, expected)  # exactly the dequantized codes, narrowed once
    assert_decoded(hidden, decoded, DatasetCodec.FP8)  # within fp8's bound of what the engine had
    from hsx.codecs.block import checksum

    assert stored.checksum == checksum(raw)  # what the lossless codec decodes back to


def test_a_corrupt_fp8_block_is_dead_lettered_with_its_reason() -> None:
    """Block 1 (tokens 4-8) replaced by one with a NaN code whose CRC and
    manifest entry match it: only its content is wrong."""
    value, codes, scales = _fp8_value(tokens=4)
    nan_codes = codes.copy()
    nan_codes[3, 0, 0] = 0xFF
    bad = _reframed(value, nan_codes, scales, token_start=4, token_end=8, dtype=DType.BFLOAT16)
    recs, _ = fp8_records(tokens=11, per_block=4)
    manifest = Manifest.model_validate_json(recs[-1].value)
    refs = list(manifest.blocks)
    refs[1] = refs[1].model_copy(update={"checksum": read_header(bad)[0].checksum})
    recs[1] = Record(recs[1].offset, recs[1].key, bad, recs[1].headers)
    dlq_value = manifest.model_copy(update={"blocks": refs}).model_dump_json().encode()
    recs[-1] = Record(recs[-1].offset, recs[-1].key, dlq_value, recs[-1].headers)
    result = _assemble(recs)
    assert isinstance(result, RejectedRecords) and result.error_class is ErrorClass.CORRUPT_BLOCK
    assert result.reason.startswith("block 1: malformed fp8 row at token 7, layer 0"), result.reason
    assert result.value == dlq_value  # the manifest goes to the DLQ, as for any rejected sample


def test_blocks_that_disagree_with_the_manifests_quantization_are_rejected() -> None:
    recs, _ = fp8_records(tokens=8, per_block=4)
    manifest = Manifest.model_validate_json(recs[-1].value)
    plain = Manifest(**{**manifest.model_dump(), "quantization": None})
    recs[-1] = Record(recs[-1].offset, recs[-1].key, plain.model_dump_json().encode(), recs[-1].headers)
    result = _assemble(recs)
    assert isinstance(result, RejectedRecords) and result.error_class is ErrorClass.CORRUPT_BLOCK
    assert "block 0 holds fp8 rows, the manifest says unquantized" in result.reason
