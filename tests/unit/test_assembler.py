"""Reassembly in the sink: complete samples pass bit-exact; every kind of damage
is rejected with a reason and never becomes a sample."""

from __future__ import annotations

import uuid

import orjson
import pytest
import torch

from hsx.codecs.block import checksum, encode_block, read_header
from hsx.codecs.framing import CorruptBlock, frame
from hsx.codecs.dataset import decode_sample
from hsx.dataset.encoding import encode
from hsx.dataset.sample import Pieces, Sample
from hsx.schemas import BlockRecordHeaders, BlockRef, Codec, DType, Manifest, RecordKind, SourceRef
from hsx.schemas.blocks import FRAME_PREFIX, MAGIC
from hsx.schemas.dataset_codec import DatasetCodec
from hsx.sink.assembler import Assembler, Record, RejectedRecords

LAYERS, HIDDEN = 2, 16


def records(request_id: str = "r-1", tokens: int = 10, per_block: int = 4, attempt: str | None = None,
            first_offset: int = 0) -> tuple[list[Record], torch.Tensor]:
    """The block records and manifest the connector would produce."""
    attempt = attempt or uuid.uuid4().hex
    hidden = torch.randn(tokens, LAYERS, HIDDEN)
    out, refs = [], []
    for index, start in enumerate(range(0, tokens, per_block)):
        rows = hidden[start : start + per_block].contiguous()
        value = encode_block(rows.view(torch.uint8).numpy(), shape=tuple(rows.shape), dtype=DType.FLOAT32,
                             token_start=start, codec=Codec.BYTEPLANE_ZSTD)
        header, _ = read_header(value)
        refs.append(BlockRef(index=index, token_start=start, token_end=header.token_end, checksum=header.checksum,
                             compressed_nbytes=len(value)))
        headers = BlockRecordHeaders(kind=RecordKind.BLOCK, attempt_id=attempt, block_index=index, codec=Codec.BYTEPLANE_ZSTD)
        out.append(Record(first_offset + index, request_id.encode(), value, headers.to_kafka()))
    manifest = Manifest(request_id=request_id, attempt_id=attempt, model="m", layer_ids=[1, 3], dtype=DType.FLOAT32,
                        hidden_size=HIDDEN, num_tokens=tokens, token_ids=list(range(tokens)), codec=Codec.BYTEPLANE_ZSTD,
                        blocks=refs, source=SourceRef(topic="p", partition=0, offset=1))
    out.append(Record(first_offset + len(refs), request_id.encode(), manifest.model_dump_json().encode(),
                      BlockRecordHeaders(kind=RecordKind.MANIFEST, attempt_id=attempt).to_kafka()))
    return out, hidden


def feed(assembler: Assembler, recs: list[Record]) -> list[Sample | RejectedRecords]:
    return [r for r in (assembler.add(rec) for rec in recs) if r is not None]


def test_interleaved_requests_reassemble_bit_exact() -> None:
    a, hidden_a = records("a", tokens=10, first_offset=0)
    b, hidden_b = records("b", tokens=3, first_offset=100)
    mixed = [a[0], b[0], a[1], b[1], a[2], a[3]]
    results = feed(Assembler(), mixed)
    assert len(results) == 2 and all(isinstance(r, Sample) for r in results)
    by_id = {r.manifest.request_id: r for r in results}  # type: ignore[union-attr]
    assert by_id["a"].hidden_states == hidden_a.numpy().tobytes()
    assert by_id["b"].hidden_states == hidden_b.numpy().tobytes()
    assert by_id["a"].offsets == [0, 1, 2, 3] and by_id["b"].offsets == [100, 101]


def test_records_kept_as_they_came_are_what_encoding_the_decoded_sample_stores() -> None:
    """Under byteplane-zstd the assembler verifies the blocks without keeping their
    raw bytes; the sample it gives is the one a decoded sample encodes to, its
    checksum (combined from the blocks') that of the raw bytes."""
    recs, hidden = records(tokens=10, per_block=3)
    (kept,) = feed(Assembler(stored_as=DatasetCodec.BYTEPLANE_ZSTD), recs)
    (decoded,) = feed(Assembler(), recs)
    assert isinstance(kept, Sample) and isinstance(decoded, Sample)
    assert decoded.hidden_states == hidden.numpy().tobytes()
    assert kept.codec is DatasetCodec.BYTEPLANE_ZSTD and not kept.records
    assert isinstance(kept.hidden_states, Pieces)  # the records' own values, never joined
    assert all(part is record.value for part, record in zip(kept.hidden_states.parts, recs[:-1], strict=True))
    assert kept.checksum == checksum(hidden.numpy().tobytes())
    assert encode(kept, DatasetCodec.BYTEPLANE_ZSTD) is kept
    stored = encode(decoded, DatasetCodec.BYTEPLANE_ZSTD)
    assert (bytes(kept.hidden_states), kept.checksum) == (bytes(stored.hidden_states), stored.checksum)


@pytest.fixture(params=[DatasetCodec.RAW, DatasetCodec.BYTEPLANE_ZSTD], ids=["decoded", "kept"])
def stored_as(request: pytest.FixtureRequest) -> DatasetCodec:
    """Both ways the assembler verifies blocks: decoding them into the sample, or
    by their payload checksums when the records are stored as they came."""
    return request.param  # type: ignore[no-any-return]


def _rejected(recs: list[Record], stored_as: DatasetCodec = DatasetCodec.RAW) -> RejectedRecords:
    (result,) = feed(Assembler(stored_as=stored_as), recs)
    assert isinstance(result, RejectedRecords)
    return result


def _mangle(record: Record, value: bytes) -> Record:
    return Record(record.offset, record.key, value, record.headers)


def test_flipped_byte_is_rejected(stored_as: DatasetCodec) -> None:
    recs, _ = records()
    value = bytearray(recs[1].value)
    value[-5] ^= 0xFF
    assert _rejected([recs[0], _mangle(recs[1], bytes(value)), *recs[2:]], stored_as).error_class == "corrupt_block"


def reframe(record: Record, payload: bytes, payload_checksum: str | None) -> Record:
    """``record`` with another payload and payload checksum (``None``: as blocks
    were written before they had one), its header otherwise the same."""
    header, _ = read_header(record.value)
    header = header.model_copy(update={"payload_checksum": payload_checksum})
    return _mangle(record, frame(MAGIC, header, [payload]))


def test_records_kept_as_they_came_are_checked_as_stored_and_decoded_where_read() -> None:
    """A block whose payload matches its payload checksum is kept without decoding
    it, even one that does not decode (a buggy or forged sender): the raw checksum
    is checked where the sample is read, which refuses it. A sink that decodes
    refuses it at once."""
    recs, _ = records(tokens=10, per_block=4)
    _, payload = read_header(recs[1].value)
    broken = bytearray(payload)
    broken[-5] ^= 0xFF
    forged = [recs[0], reframe(recs[1], bytes(broken), checksum(broken)), *recs[2:]]
    (kept,) = feed(Assembler(stored_as=DatasetCodec.BYTEPLANE_ZSTD), forged)
    assert isinstance(kept, Sample)
    with pytest.raises(CorruptBlock, match="block of tokens \\[4, 8\\)|does not decompress|checksum mismatch"):
        decode_sample(bytes(kept.hidden_states), shape=(10, LAYERS, HIDDEN), dtype=DType.FLOAT32,
                      codec=DatasetCodec.BYTEPLANE_ZSTD)
    assert _rejected(forged).error_class == "corrupt_block"


def test_records_written_before_payload_checksums_are_verified_by_decoding(stored_as: DatasetCodec) -> None:
    recs, hidden = records(tokens=10, per_block=4)
    legacy = [reframe(r, bytes(read_header(r.value)[1]), None) for r in recs[:-1]]
    assert all(b"payload_checksum" not in r.value for r in legacy)
    (sample,) = feed(Assembler(stored_as=stored_as), [*legacy, recs[-1]])
    assert isinstance(sample, Sample) and sample.codec is stored_as
    assert decode_sample(bytes(sample.hidden_states), shape=(10, LAYERS, HIDDEN), dtype=DType.FLOAT32,
                         codec=stored_as) == hidden.numpy().tobytes()
    _, payload = read_header(legacy[1].value)
    broken = bytearray(payload)
    broken[-5] ^= 0xFF
    damaged = [legacy[0], reframe(legacy[1], bytes(broken), None), *legacy[2:], recs[-1]]
    assert _rejected(damaged, stored_as).error_class == "corrupt_block"


def test_truncated_block_is_rejected(stored_as: DatasetCodec) -> None:
    recs, _ = records()
    assert _rejected([_mangle(recs[0], recs[0].value[:-10]), *recs[1:]], stored_as).error_class == "corrupt_block"


def test_manifest_without_its_blocks_is_rejected() -> None:
    recs, _ = records()
    rejected = _rejected([recs[0], recs[-1]])
    assert rejected.error_class == "incomplete_sample" and "never arrived" in rejected.reason
    assert rejected.value == recs[-1].value  # the manifest goes to the DLQ


def test_blocks_from_another_attempt_do_not_count() -> None:
    old, _ = records("r-1", attempt="a" * 32)
    new, _ = records("r-1", attempt="b" * 32, first_offset=50)
    assembler = Assembler()
    assert feed(assembler, old[:-1] + new[:1]) == []
    (result,) = feed(assembler, [new[-1]])
    assert isinstance(result, RejectedRecords) and result.error_class == "incomplete_sample"


def test_blocks_whose_manifest_never_comes_expire() -> None:
    recs, _ = records()
    assembler = Assembler(incomplete_timeout=10)
    assert feed(assembler, recs[:-1] + recs[:1]) == []  # the first block twice: held (and counted) once
    assert assembler.pending_bytes == sum(len(r.value) for r in recs[:-1])
    assert assembler.expire(now=0) == []
    (expired,) = assembler.expire(now=10**9)
    assert expired.error_class == "incomplete_sample" and expired.offsets == [0, 1, 2]
    assert assembler.pending_bytes == 0


def test_a_completed_attempt_supersedes_the_unfinished_ones() -> None:
    killed, _ = records("r-1", first_offset=0)  # an extractor died after two blocks
    retried, hidden = records("r-1", first_offset=10)
    other, _ = records("r-2", first_offset=20)
    assembler = Assembler()
    assert feed(assembler, killed[:2] + other[:1]) == []
    (sample,) = feed(assembler, retried)
    assert isinstance(sample, Sample) and sample.hidden_states == hidden.numpy().tobytes()
    (stale,) = assembler.supersede("r-1")
    assert stale.error_class == "superseded_attempt" and stale.offsets == [0, 1] and stale.request_id == "r-1"
    assert assembler.supersede("r-1") == []
    assert assembler.pending_bytes == len(other[0].value)  # r-2 is untouched


def test_wrong_shape_is_rejected() -> None:
    recs, _ = records()
    manifest = orjson.loads(recs[-1].value)
    manifest["hidden_size"] = HIDDEN * 2
    rejected = _rejected([*recs[:-1], _mangle(recs[-1], orjson.dumps(manifest))])
    assert rejected.error_class == "shape_mismatch"


@pytest.mark.parametrize(
    "change, error_class",
    [
        (lambda m: {**m, "num_tokens": 99}, "invalid_manifest"),
        (lambda m: {**m, "request_id": "someone-else"}, "invalid_manifest"),
        (lambda m: {**m, "request_id": "../../etc"}, "invalid_manifest"),
        (lambda m: {**m, "blocks": m["blocks"][:1]}, "invalid_manifest"),
    ],
)
def test_invalid_manifest_is_rejected(change, error_class: str) -> None:  # type: ignore[no-untyped-def]
    recs, _ = records()
    manifest = change(orjson.loads(recs[-1].value))
    assert _rejected([*recs[:-1], _mangle(recs[-1], orjson.dumps(manifest))]).error_class == error_class


def test_unreadable_headers_are_rejected() -> None:
    recs, _ = records()
    bad = Record(7, b"r-1", recs[0].value, [("kind", b"mystery")])
    rejected = _rejected([bad])
    assert rejected.error_class == "invalid_record" and rejected.offsets == [7]
    assert (rejected.request_id, rejected.value) == ("r-1", recs[0].value)  # the DLQ keeps the record whole


def test_garbage_manifest_is_rejected() -> None:
    recs, _ = records()
    assert _rejected([*recs[:-1], _mangle(recs[-1], b"{not json")]).error_class == "invalid_manifest"


def forge(recs: list[Record], tokens: int, hidden: int) -> list[Record]:
    """Block 0's header and the manifest agree on ``tokens`` x LAYERS x ``hidden``;
    the payload stays the few bytes it was."""
    header, payload = read_header(recs[0].value)
    forged = header.model_dump(mode="json", exclude_none=True) | {"shape": [tokens, LAYERS, hidden],
                                                                  "token_end": tokens}
    header_bytes = orjson.dumps(forged)
    block = FRAME_PREFIX.pack(MAGIC, len(header_bytes)) + header_bytes + bytes(payload)
    manifest = orjson.loads(recs[-1].value)
    manifest |= {"hidden_size": hidden, "num_tokens": tokens, "token_ids": [0] * tokens,
                 "blocks": [manifest["blocks"][0] | {"token_end": tokens, "compressed_nbytes": len(block)}]}
    return [_mangle(recs[0], block), _mangle(recs[-1], orjson.dumps(manifest))]


def test_a_header_declaring_more_than_its_payload_holds_is_rejected_before_any_allocation(stored_as: DatasetCodec) -> None:
    """Found by the held-out check of #35: 4 x 2 x 2**31 float32 (64 GiB) over a
    few hundred bytes raised MemoryError in the sink (its buffers were sized from
    the header before the payload was checked), which stopped the sink."""
    recs, _ = records(tokens=4, per_block=4)
    rejected = Assembler(stored_as=stored_as, max_sample_bytes=1 << 40).add  # the size rule alone would not catch it
    (result,) = [r for r in map(rejected, forge(recs, tokens=4, hidden=2**31)) if r is not None]
    assert isinstance(result, RejectedRecords) and result.error_class == "corrupt_block", result
    assert str(4 * LAYERS * 2**31) in result.reason and result.offsets == [0, 1]  # a plane of the declared size


def test_a_sample_over_the_size_limit_is_rejected_from_its_manifest() -> None:
    recs, _ = records(tokens=10, per_block=4)
    raw = 10 * LAYERS * HIDDEN * 4
    assert isinstance(feed(Assembler(max_sample_bytes=raw), recs)[0], Sample)
    (rejected,) = feed(Assembler(max_sample_bytes=raw - 1), recs)
    assert isinstance(rejected, RejectedRecords) and rejected.error_class == "sample_too_large"
    assert f"{raw} bytes of hidden states" in rejected.reason and rejected.offsets == [0, 1, 2, 3]


def test_a_staged_object_over_the_size_limit_is_rejected_before_it_is_fetched() -> None:
    recs, _ = records(tokens=4, per_block=4)
    manifest = Manifest.model_validate_json(recs[-1].value).by_reference()
    huge = orjson.loads(manifest.model_dump_json())
    huge["payload"]["nbytes"] = huge["blocks"][0]["compressed_nbytes"] = 10**15
    (rejected,) = feed(Assembler(), [_mangle(recs[-1], orjson.dumps(huge))])
    assert isinstance(rejected, RejectedRecords) and rejected.error_class == "sample_too_large"
    assert "staged object of 1000000000000000 bytes" in rejected.reason


def test_an_exception_no_rule_names_dead_letters_the_record_and_its_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    """The last line of defence: the loop goes on, the record is dead-lettered as
    ``unexpected`` with the exception, nothing of the attempt stays pending."""
    def broken(*args: object, **kwargs: object) -> None:
        raise ZeroDivisionError("a defect")

    monkeypatch.setattr("hsx.sink.block_checks.decode_block", broken)
    recs, _ = records(tokens=10, per_block=4)
    assembler = Assembler()
    (rejected,) = feed(assembler, recs)
    assert isinstance(rejected, RejectedRecords) and rejected.error_class == "unexpected"
    assert rejected.reason.startswith("unexpected ZeroDivisionError") and "a defect" in rejected.reason
    assert rejected.offsets == [0, 1, 2, 3] and rejected.value == recs[-1].value and assembler.pending_bytes == 0
