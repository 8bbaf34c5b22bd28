"""Fuzz targets for every parser of bytes that come over the wire: Kafka records
(their values and headers) and the staged objects of by-reference samples. Each
target hands the bytes to the very function the service calls on them.

Targets that take more than one record frame them in the fuzz input, with lengths
little-endian, every length cut to the bytes left (so that any input frames
something, and a mutation of one length does not throw away the rest)::

    records   = record*                                      (until the input ends)
    record    = u16 key length (0xFFFF: no key) | key
              | headers
              | u32 value length | value
    headers   = u8 count (0xFF: no header list) | header*
    header    = u8 name length | name (UTF-8, bad bytes replaced)
              | u16 value length (0xFFFF: a null value) | value

``staged_object`` is one record (the manifest) followed by the staged object,
which is the rest of the input; ``dlq_headers`` is one ``headers``;
``dataset_sample`` starts with the sample's shape and types (:data:`SAMPLE_PREFIX`).

:func:`seeds` makes the seed inputs of every target from real records: hidden
states encoded with hsx's own block, fp8 and dataset codecs, manifests, prompt
events, ready events and dead-letter headers as the services write them.
"""

from __future__ import annotations

import math
import struct
import tempfile
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from confluent_kafka import Message as KafkaMessage
from pydantic import JsonValue, ValidationError

from hsx.codecs.block import decode_block, encode_block, read_header, verify_stored
from hsx.codecs.framing import CorruptBlock, frame
from hsx.codecs.dataset import decode_sample, encode_sample
from hsx.codecs.fp8 import narrow
from hsx.codecs.fp8_blocks import fp8_rows, quantize_block
from hsx.dataset.sample import Sample
from hsx.dataset.storage import LocalStorage
from hsx.extractor.cli import _max_model_len as default_max_model_len
from hsx.extractor.model_config import text_config
from hsx.extractor.prompts import PromptPreparer, PromptRejected
from hsx.running.ledger import Ledger, account
from hsx.models import prepare
from hsx.schemas import (
    DEFAULT_LIMITS,
    BlockRecordHeaders,
    BlockRef,
    Codec,
    DlqHeaders,
    DType,
    ErrorClass,
    GeneratedTurn,
    Generation,
    GenerationRecord,
    HiddenStatesReady,
    Manifest,
    PromptEvent,
    RecordKind,
    SourceRef,
    TensorNames,
    Topics,
    format_validation_error,
    ready_event_id,
    staged_key,
)
from hsx.schemas.blocks import MAGIC
from hsx.schemas.common import Capture
from hsx.schemas.dataset_codec import DatasetCodec
from hsx.schemas.topics import READY
from hsx.sink.assembler import Assembler, Record, RejectedRecords, Staged
from hsx.sink.payloads import PayloadReader
from hsx.trainer.consume import ready_event as ready_event_of
from hsx.trainer.samples import check_trainable, choose_layers
from tests.fuzz.target import target

MAX_SAMPLE_BYTES = 16 << 20
"""The sink's ``--max-sample-bytes`` in the assembler targets: far below the
replay's allocation bound, so that a sample the limit lets through cannot reach it."""

TOKENIZER_MODEL = "tiny-llama"
"""The model whose tokenizer and chat template prepare prompts (``hsx models prepare``)."""

_NO_KEY = 0xFFFF
_NO_HEADERS = 0xFF
_NULL_VALUE = 0xFFFF


class _Cursor:
    """Reads the framing of a fuzz input front to back; past the end it reads short."""

    def __init__(self, data: bytes) -> None:
        self._data = data
        self._at = 0

    @property
    def left(self) -> int:
        return len(self._data) - self._at

    def take(self, n: int) -> bytes:
        chunk = self._data[self._at : self._at + n]
        self._at += len(chunk)
        return chunk

    def uint(self, width: int) -> int:
        return int.from_bytes(self.take(width), "little")

    def rest(self) -> bytes:
        return self.take(self.left)


def _read_headers(cursor: _Cursor) -> list[tuple[str, bytes | None]] | None:
    count = cursor.uint(1)
    if count == _NO_HEADERS:
        return None
    headers: list[tuple[str, bytes | None]] = []
    for _ in range(count):
        if not cursor.left:
            break
        name = cursor.take(cursor.uint(1)).decode("utf-8", "replace")
        size = cursor.uint(2)
        headers.append((name, None if size == _NULL_VALUE else cursor.take(size)))
    return headers


def _read_record(cursor: _Cursor, offset: int) -> Record:
    size = cursor.uint(2)
    key = None if size == _NO_KEY else cursor.take(size)
    headers = _read_headers(cursor)
    return Record(offset, key, cursor.take(cursor.uint(4)), headers)


def read_records(data: bytes) -> list[Record]:
    """The Kafka records framed in ``data`` (module docstring), at offsets 0, 1, ..."""
    cursor = _Cursor(data)
    records: list[Record] = []
    while cursor.left:
        records.append(_read_record(cursor, len(records)))
    return records


def frame_headers(headers: Sequence[tuple[str, bytes | None]] | None) -> bytes:
    """``headers`` framed as :func:`_read_headers` reads them."""
    if headers is None:
        return bytes([_NO_HEADERS])
    out = [bytes([len(headers)])]
    for name, value in headers:
        encoded = name.encode()
        out += [bytes([len(encoded)]), encoded,
                struct.pack("<H", _NULL_VALUE if value is None else len(value)), value or b""]
    return b"".join(out)


def frame_records(records: Iterable[Record]) -> bytes:
    """``records`` framed as :func:`read_records` reads them."""
    out = []
    for record in records:
        key = struct.pack("<H", _NO_KEY) if record.key is None else struct.pack("<H", len(record.key)) + record.key
        out += [key, frame_headers(record.headers), struct.pack("<I", len(record.value)), record.value]
    return b"".join(out)


# -- prompts --------------------------------------------------------------------------------------


def _preparer() -> PromptPreparer:
    """The extractor's preparer for the tiny model, as ``hsx extract`` builds it
    (``max_model_len``: the default, cut to the model's context)."""
    from transformers import AutoTokenizer

    model = str(prepare(names=[TOKENIZER_MODEL])[TOKENIZER_MODEL])
    config = text_config(model)
    max_model_len = default_max_model_len(None, config.max_position_embeddings)
    return PromptPreparer(AutoTokenizer.from_pretrained(model), config.vocab_size, max_model_len)


# Loaded once, at import: the fuzzer's first input must not pay for it.
_PREPARER = _preparer()


@target("prompt_event", ValidationError, PromptRejected)
def prompt_event(data: bytes) -> None:
    """A ``prompts`` record's value: validated as a PromptEvent and tokenized, as the extractor does."""
    try:
        event = PromptEvent.model_validate_json(data, context={"limits": DEFAULT_LIMITS})
    except ValidationError as exc:
        format_validation_error(exc)  # the dead letter's reason
        raise
    _PREPARER.prepare(event)


# -- block records and samples --------------------------------------------------------------------


@target("block_record", CorruptBlock)
def block_record(data: bytes) -> None:
    """A ``hidden_states.blocks`` block record's value, any codec (fp8 too), decoded and verified as the sink does."""
    header, raw = decode_block(data)
    if header.quantization is None:
        verify_stored(data)
    else:
        fp8_rows(header, raw)


SAMPLE_PREFIX = struct.Struct("<3IB")
"""``dataset_sample``'s first bytes: the sample's ``[tokens, layers, hidden]``
(0 reads as 1: an index's shape is positive), then a byte choosing its dtype
(``% 3``) and its dataset codec (``// 3 % 4``). The rest is the stored bytes."""
_DTYPES = list(DType)
_DATASET_CODECS = list(DatasetCodec)


@target("dataset_sample", CorruptBlock)
def dataset_sample(data: bytes) -> None:
    """A sample's stored hidden-states bytes, decoded for the shape its index entry gives, as readers do."""
    tokens, layers, hidden, kind = SAMPLE_PREFIX.unpack(data[: SAMPLE_PREFIX.size].ljust(SAMPLE_PREFIX.size, b"\0"))
    shape = (tokens or 1, layers or 1, hidden or 1)
    dtype, codec = _DTYPES[kind % 3], _DATASET_CODECS[kind // 3 % 4]
    # Readers hand over the shard's tensor as numpy (hsx.dataset.encoding.read_hidden_states).
    raw = decode_sample(np.frombuffer(data[SAMPLE_PREFIX.size :], dtype=np.uint8), shape=shape, dtype=dtype,
                        codec=codec)
    if len(raw) != math.prod(shape) * dtype.itemsize:
        raise AssertionError(f"{codec.value} decoded {len(raw)} bytes for shape {shape} of {dtype.value}")


def _settled(result: Sample | Staged | RejectedRecords | None) -> None:
    """``unexpected`` is the assembler's last line of defence, never a rule: a record
    that reaches it is a defect."""
    if isinstance(result, RejectedRecords) and result.error_class is ErrorClass.UNEXPECTED:
        raise AssertionError(f"dead-lettered as unexpected: {result.reason}")


_STORED_AS = (DatasetCodec.RAW, DatasetCodec.BYTEPLANE_ZSTD)
"""Both ways the assembler verifies blocks: decoded into the sample, or kept as they came."""


@target("block_stream")
def block_stream(data: bytes) -> None:
    """Records of ``hidden_states.blocks`` (key, headers, value) through the sink's assembler, then expired."""
    records = read_records(data)
    for stored_as in _STORED_AS:
        assembler = Assembler(stored_as=stored_as, max_sample_bytes=MAX_SAMPLE_BYTES)
        for record in records:
            result = assembler.add(record)
            _settled(result)
            if isinstance(result, Sample):
                for stale in assembler.supersede(result.manifest.request_id):
                    _settled(stale)
        for expired in assembler.expire(now=float("inf")):
            _settled(expired)


# The payload store of staged_object: a directory the sink reads as it would any.
_PAYLOAD_DIR = tempfile.TemporaryDirectory(prefix="hsx-fuzz-payloads-")
_PAYLOAD_STORE = LocalStorage(Path(_PAYLOAD_DIR.name))
_PAYLOADS = PayloadReader(_PAYLOAD_STORE, lambda error: None)  # fetch() raises; only the sink's loop calls fail


@target("staged_object")
def staged_object(data: bytes) -> None:
    """A by-reference manifest record and its staged object, read and verified as the sink does."""
    cursor = _Cursor(data)
    manifest = _read_record(cursor, 0)
    staged_bytes = cursor.rest()
    for stored_as in _STORED_AS:
        assembler = Assembler(stored_as=stored_as, max_sample_bytes=MAX_SAMPLE_BYTES)
        staged = assembler.add(manifest)
        _settled(staged)
        if not isinstance(staged, Staged):
            continue
        # Where the extractor uploads it; a manifest naming another key is refused before any read.
        path = _PAYLOAD_STORE.local_path(staged_key(staged.manifest.request_id, staged.manifest.attempt_id))
        path.write_bytes(staged_bytes)
        try:
            _settled(_PAYLOADS.fetch(staged, assembler))
        finally:
            path.unlink()


# -- events read back -----------------------------------------------------------------------------


@target("ready_event", ValueError)
def ready_event(data: bytes) -> None:
    """A ``hidden_states.ready`` record's value, as the online trainer reads it (hsx run and follow() parse it alike)."""
    event = ready_event_of(KafkaMessage(topic=READY, partition=0, offset=0, value=data))
    check_trainable(event)
    choose_layers(event.layer_ids)


@target("ledger_records", ValueError)
def ledger_records(data: bytes) -> None:
    """Records on ``hsx run``'s ledger topics (ready events, then prompt and block
    dead letters in turn), each accounted for as its ``LedgerFeed`` does: a record
    it cannot read is skipped (``ValueError``), anything else would stop the run."""
    topics = Topics()
    ledger = Ledger(published={"a", "b"})
    for i, record in enumerate(read_records(data)):
        topic = (topics.ready, topics.prompts_dlq, topics.blocks_dlq)[i % 3]
        try:
            account(ledger, topics, KafkaMessage(topic=topic, partition=0, offset=record.offset, key=record.key,
                                                 value=record.value, headers=record.headers))
        except ValueError:
            continue


@target("dlq_headers", ValidationError)
def dlq_headers(data: bytes) -> None:
    """A dead letter's Kafka headers, as ``hsx run``'s ledger reads them."""
    DlqHeaders.from_kafka(_read_headers(_Cursor(data)))


# -- seeds ----------------------------------------------------------------------------------------

LAYERS, HIDDEN = 2, 16


def _rows(tokens: int, dtype: DType, seed: int, coarse: bool = False) -> bytes:
    """Hidden states ``[tokens, LAYERS, HIDDEN]`` as raw bytes of ``dtype``. ``coarse``:
    on a grid of halves, which zstd compresses (random mantissas it leaves raw), so
    that seeds reach the zstd decoders too."""
    values = np.random.default_rng(seed).standard_normal((tokens, LAYERS, HIDDEN), dtype=np.float32)
    return narrow(np.round(values * 2) / 2 if coarse else values, dtype).tobytes()


def _attempt(request_id: str, attempt: str, *, tokens: int = 6, per_block: int = 3, dtype: DType = DType.BFLOAT16,
             codec: Codec = Codec.BYTEPLANE_ZSTD, fp8: bool = False, capture: Capture = "all", chat: bool = False,
             generated: bool = False, metadata: dict[str, JsonValue] | None = None,
             coarse: bool = False) -> tuple[list[bytes], Manifest]:
    """The block values and manifest the connector sends for one attempt."""
    first = tokens - 1 if capture == "last" else 0
    raw = _rows(tokens - first, dtype, seed=len(request_id) + tokens, coarse=coarse)
    row = LAYERS * HIDDEN * dtype.itemsize
    values, refs = [], []
    for index, start in enumerate(range(first, tokens, per_block)):
        end = min(start + per_block, tokens)
        rows = raw[(start - first) * row : (end - first) * row]
        encode = quantize_block if fp8 else encode_block
        value = encode(rows, shape=(end - start, LAYERS, HIDDEN), dtype=dtype, token_start=start, codec=codec)
        header, _ = read_header(value)
        refs.append(BlockRef(index=index, token_start=start, token_end=end, checksum=header.checksum,
                             compressed_nbytes=len(value)))
        values.append(value)
    generation = GenerationRecord(params=Generation(max_tokens=3), final_token_id=7, turns=[
        GeneratedTurn(token_start=tokens - 2, token_end=tokens + 1, finish_reason="length")]) if generated else None
    manifest = Manifest(request_id=request_id, attempt_id=attempt, model=TOKENIZER_MODEL, layer_ids=[1, 3],
                        dtype=dtype, hidden_size=HIDDEN, num_tokens=tokens, token_ids=list(range(3, 3 + tokens)),
                        loss_mask_spans=[(2, tokens)] if chat else None, codec=codec,
                        quantization="fp8" if fp8 else None, blocks=refs, metadata=metadata,
                        source=SourceRef(topic="prompts", partition=0, offset=41), generation=generation,
                        capture=capture)
    return values, manifest


def _manifest_value(manifest: Manifest) -> bytes:
    """The manifest's record value as the connector writes it (fields it does not use left out)."""
    unused: dict[str, Any] = {} if manifest.quantization else {"quantization": True}
    if manifest.payload is None:
        unused |= {"payload": True, "blocks": {"__all__": {"offset"}}}
    return manifest.model_dump_json(exclude=unused).encode()


def _records(values: list[bytes], manifest: Manifest, first_offset: int = 0) -> list[Record]:
    key = manifest.request_id.encode()
    out = [Record(first_offset + i, key, value, BlockRecordHeaders(
        kind=RecordKind.BLOCK, attempt_id=manifest.attempt_id, block_index=i, codec=manifest.codec).to_kafka())
        for i, value in enumerate(values)]
    manifest_headers = BlockRecordHeaders(kind=RecordKind.MANIFEST, attempt_id=manifest.attempt_id).to_kafka()
    return [*out, Record(first_offset + len(out), key, _manifest_value(manifest), manifest_headers)]


def _attempt_id(n: int) -> str:
    return f"{n:032x}"


def _block_streams() -> list[list[Record]]:
    inline = _records(*_attempt("r-1", _attempt_id(1), dtype=DType.FLOAT32))
    chat = _records(*_attempt("chat.2", _attempt_id(2), codec=Codec.ZSTD, chat=True, generated=True,
                              metadata={"source": "fuzz", "n": 1}, coarse=True))
    fp8 = _records(*_attempt("fp8:3", _attempt_id(3), fp8=True, per_block=4))
    last = _records(*_attempt("last-4", _attempt_id(4), codec=Codec.NONE, dtype=DType.FLOAT16, capture="last"))
    killed = _records(*_attempt("r-5", _attempt_id(5), tokens=4, per_block=2))[:1]
    retried = _records(*_attempt("r-5", _attempt_id(6), tokens=4, per_block=2))
    other = _records(*_attempt("r-7", _attempt_id(7), tokens=3, per_block=3, codec=Codec.ZSTD, coarse=True))
    fp8_whole = _records(*_attempt("fp8-9", _attempt_id(9), fp8=True, per_block=6, codec=Codec.ZSTD, coarse=True))
    inline_values, by_reference = _attempt("ref-8", _attempt_id(8))
    staged = _records([], by_reference.by_reference())
    both_ways = _records(inline_values, by_reference)[:-1] + staged  # refused: by reference, but blocks came
    interleaved = [killed[0], other[0], retried[0], retried[1], other[1], retried[2]]
    return [inline, chat, fp8, fp8_whole, last, interleaved, staged, both_ways, retried[:-1]]


def _staged_objects() -> list[bytes]:
    out = []
    for values, manifest in (_attempt("ref-1", _attempt_id(11)),
                             _attempt("ref-2", _attempt_id(12), fp8=True, tokens=5, per_block=2, coarse=True),
                             _attempt("ref-3", _attempt_id(13), dtype=DType.FLOAT32, codec=Codec.NONE, chat=True)):
        (record,) = _records([], manifest.by_reference())
        out.append(frame_records([record]) + b"".join(values))
    return out


def without_payload_checksum(value: bytes) -> bytes:
    """A block record as encoders wrote it before blocks carried a payload checksum."""
    header, payload = read_header(value)
    return frame(MAGIC, header.model_copy(update={"payload_checksum": None}), [payload])


def _block_records() -> list[bytes]:
    out = []
    for dtype in DType:
        for codec in Codec:
            out.append(encode_block(_rows(2, dtype, seed=1), shape=(2, LAYERS, HIDDEN), dtype=dtype, token_start=4,
                                    codec=codec))
        out.append(encode_block(_rows(2, dtype, seed=1, coarse=True), shape=(2, LAYERS, HIDDEN), dtype=dtype,
                                token_start=0, codec=Codec.ZSTD))
    # as encoders wrote them before blocks carried a payload checksum: the sink decodes these to verify them
    out += [without_payload_checksum(value) for value in out[-len(Codec) - 1:]]
    for codec, coarse in ((Codec.NONE, False), (Codec.BYTEPLANE_ZSTD, False), (Codec.ZSTD, True)):
        out.append(quantize_block(_rows(3, DType.BFLOAT16, seed=2, coarse=coarse), shape=(3, LAYERS, HIDDEN),
                                  dtype=DType.BFLOAT16, token_start=0, codec=codec))
    return out


def _dataset_samples() -> list[bytes]:
    out = []
    tokens = 3
    for dtype_index, dtype in enumerate(_DTYPES):
        for codec_index, codec in enumerate(_DATASET_CODECS):
            for coarse in (False, True) if codec is not DatasetCodec.RAW else (False,):
                stored = encode_sample(_rows(tokens, dtype, seed=3, coarse=coarse), shape=(tokens, LAYERS, HIDDEN),
                                       dtype=dtype, codec=codec)
                out.append(SAMPLE_PREFIX.pack(tokens, LAYERS, HIDDEN, codec_index * 3 + dtype_index) + stored)
    return out


def _prompt_events() -> list[bytes]:
    png = "data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR4nGNgYGBgAAAABQABpfZFQAAAAABJRU5ErkJggg=="
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 2?"},
            {"role": "assistant", "content": "4."}, {"role": "user", "content": "And 3 + 3?"},
            {"role": "assistant", "content": "6."}]
    events = [
        {"request_id": "p-1", "prompt": "The quick brown fox jumps over the lazy dog."},
        {"request_id": "p-2", "token_ids": [1, 17, 230, 999, 4], "metadata": {"split": "train", "tags": ["a", 1]}},
        {"request_id": "p-3", "messages": chat},
        {"request_id": "p-4", "messages": chat, "generation": {"max_tokens": 8, "turns": "all", "temperature": 0.7,
                                                                "stop": ["\n\n"], "seed": 3}},
        {"request_id": "p-5", "messages": chat[:4], "generation": {"max_tokens": 4, "turns": "last"},
         "chat_template_kwargs": {"enable_thinking": False}},
        {"request_id": "p-6", "messages": [{"role": "user", "content": [
            {"type": "text", "text": "Describe it."}, {"type": "image_url", "image_url": {"url": png}}]}]},
        {"request_id": "p-7", "prompt": "def f(x):\n    return x * 2\n", "capture": "last",
         "generation": {"max_tokens": 16, "top_p": 0.9, "top_k": 20}},
    ]
    return [PromptEvent.model_validate(event, context={"limits": DEFAULT_LIMITS}).model_dump_json(
        exclude_none=True).encode() for event in events]


def _ready(manifest: Manifest, codec: DatasetCodec) -> bytes:
    """The ready event the sink publishes for ``manifest``'s sample (as ``write_shard`` makes it)."""
    rid = manifest.request_id
    names = TensorNames(hidden_states=f"{rid}/hidden_states", token_ids=f"{rid}/token_ids",
                        loss_mask=f"{rid}/loss_mask" if manifest.loss_mask_spans is not None else None)
    return HiddenStatesReady(
        event_id=ready_event_id("fuzz", rid), request_id=rid, shard="shards/blocks-0-00000000000000000041.safetensors",
        tensors=names, num_tokens=manifest.num_tokens, layer_ids=manifest.layer_ids, dtype=manifest.dtype,
        hidden_size=manifest.hidden_size, model=manifest.model, checksum=manifest.blocks[0].checksum,
        metadata=manifest.metadata, generation=manifest.generation, capture=manifest.capture, codec=codec,
        shape=(manifest.captured_tokens, len(manifest.layer_ids), manifest.hidden_size),
    ).model_dump_json().encode()


def _ready_events() -> list[bytes]:
    return [
        _ready(_attempt("r-1", _attempt_id(1))[1], DatasetCodec.RAW),
        _ready(_attempt("chat.2", _attempt_id(2), chat=True, generated=True, metadata={"k": [1, 2]})[1],
               DatasetCodec.BYTEPLANE_ZSTD),
        _ready(_attempt("fp8:3", _attempt_id(3), fp8=True)[1], DatasetCodec.FP8_ZSTD),
        _ready(_attempt("last-4", _attempt_id(4), capture="last")[1], DatasetCodec.FP8),
    ]


def _dlq_headers() -> list[bytes]:
    return [frame_headers(headers.to_kafka()) for headers in (
        DlqHeaders.build(ErrorClass.PROMPT_TOO_LONG, "4100 tokens; at most 2047 fit max_model_len", service="extractor",
                         source_topic="prompts", source_partition=1, source_offset=12),
        DlqHeaders.build(ErrorClass.CORRUPT_BLOCK, "block 0: checksum mismatch", service="sink",
                         source_topic="hidden_states.blocks", source_partition=0, source_offset=3),
        DlqHeaders.build(ErrorClass.INVALID_JSON, "not valid JSON: unexpected character", service="producer",
                         source_file="prompts.jsonl", source_line=7),
    )]


def _ledger_records() -> list[bytes]:
    """A ready event, a prompt's and a block's dead letters, as the services write them."""
    ready = _ready_events()[0]
    headers = [DlqHeaders.from_kafka(_read_headers(_Cursor(h))).to_kafka() for h in _dlq_headers()[:2]]
    return [frame_records([Record(0, b"a", ready, None), Record(1, b"b", b"", headers[0]),
                           Record(2, b"a", b"", headers[-1])])]


def seeds() -> dict[str, list[bytes]]:
    """Seed inputs of every target in this module, from real records (deterministic)."""
    return {
        "prompt_event": _prompt_events(),
        "block_record": _block_records(),
        "dataset_sample": _dataset_samples(),
        "block_stream": [frame_records(stream) for stream in _block_streams()],
        "staged_object": _staged_objects(),
        "ready_event": _ready_events(),
        "dlq_headers": _dlq_headers(),
        "ledger_records": _ledger_records(),
    }
