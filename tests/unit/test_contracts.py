"""The non-prompt contracts: committed JSON Schemas, block record headers, the
manifest's self-consistency, ready events and dead-letter headers."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from hsx.schemas import (
    BlockHeader,
    BlockRecordHeaders,
    BlockRef,
    Codec,
    DlqHeaders,
    DType,
    HiddenStatesReady,
    Manifest,
    RecordKind,
    SourceRef,
    TensorNames,
    ready_event_id,
)
from hsx.schemas.generate import JSON_DIR, render

ATTEMPT = "0123456789abcdef0123456789abcdef"


def test_committed_json_schemas_match_the_models() -> None:
    rendered = render()
    committed = {p.name: p.read_bytes() for p in JSON_DIR.glob("*.schema.json")}
    assert committed.keys() == rendered.keys(), "run `make schemas` and commit schemas/json"
    for name, content in rendered.items():
        assert committed[name] == content, f"{name} drifted from its model: run `make schemas` and commit it"


def test_block_record_headers_round_trip() -> None:
    headers = BlockRecordHeaders(kind=RecordKind.BLOCK, attempt_id=ATTEMPT, block_index=7, codec=Codec.BYTEPLANE_ZSTD)
    kafka = headers.to_kafka()
    assert dict(kafka)["block-index"] == b"7"
    assert BlockRecordHeaders.from_kafka(kafka) == headers
    manifest = BlockRecordHeaders(kind=RecordKind.MANIFEST, attempt_id=ATTEMPT)
    assert BlockRecordHeaders.from_kafka(manifest.to_kafka()) == manifest


@pytest.mark.parametrize(
    "headers, field",
    [
        ([("kind", b"blob"), ("attempt-id", ATTEMPT.encode())], "kind"),
        ([("kind", b"manifest"), ("attempt-id", b"not-hex")], "attempt_id"),
        ([("kind", b"block"), ("attempt-id", ATTEMPT.encode()), ("schema-version", b"1"), ("codec", b"zstd")], "(event)"),
        ([("kind", b"manifest"), ("attempt-id", ATTEMPT.encode())], "schema_version"),
        ([("kind", b"block"), ("attempt-id", ATTEMPT.encode()), ("block-index", b"x"), ("codec", b"zstd")], "block_index"),
        (None, "kind"),
    ],
)
def test_bad_block_record_headers_are_rejected(headers: list | None, field: str) -> None:
    with pytest.raises(ValidationError) as info:
        BlockRecordHeaders.from_kafka(headers)
    locs = {".".join(map(str, e["loc"])) or "(event)" for e in info.value.errors()}
    assert field in locs


def test_block_header_checks_token_range() -> None:
    common: dict = dict(codec=Codec.NONE, dtype=DType.BFLOAT16, checksum="crc32:0000abcd", segments=[{"encoding": "zstd", "nbytes": 10}])
    header = BlockHeader(shape=(4, 3, 8), token_start=4, token_end=8, **common)
    assert header.raw_nbytes == 4 * 3 * 8 * 2
    with pytest.raises(ValidationError, match="token_end - token_start"):
        BlockHeader(shape=(4, 3, 8), token_start=4, token_end=9, **common)


def _manifest(**changes: object) -> dict:
    base: dict = dict(
        request_id="r-1",
        attempt_id=ATTEMPT,
        model="tiny",
        layer_ids=[1, 2, 4],
        dtype="float32",
        hidden_size=8,
        num_tokens=5,
        token_ids=[1, 2, 3, 4, 5],
        loss_mask_spans=[(3, 5)],
        codec="byteplane-zstd",
        blocks=[
            dict(index=0, token_start=0, token_end=3, checksum="crc32:00000001", compressed_nbytes=10),
            dict(index=1, token_start=3, token_end=5, checksum="crc32:00000002", compressed_nbytes=10),
        ],
        source=dict(topic="prompts", partition=0, offset=3),
    )
    base.update(changes)
    return base


def test_valid_manifest() -> None:
    manifest = Manifest.model_validate(_manifest(), strict=False)
    assert manifest.blocks[1] == BlockRef(index=1, token_start=3, token_end=5, checksum="crc32:00000002", compressed_nbytes=10)
    assert manifest.source == SourceRef(topic="prompts", partition=0, offset=3)


@pytest.mark.parametrize(
    "changes, rule",
    [
        ({"token_ids": [1, 2, 3]}, "len(token_ids) must equal num_tokens"),
        ({"num_tokens": 6, "token_ids": [1] * 6}, "cover exactly num_tokens"),
        ({"loss_mask_spans": [(4, 9)]}, "outside"),
        ({"layer_ids": [1, 1]}, "unique"),
        ({"layer_ids": []}, "at least 1"),
        ({"blocks": []}, "at least 1"),
        (
            {"blocks": [dict(index=0, token_start=0, token_end=2, checksum="crc32:00000001", compressed_nbytes=1),
                        dict(index=1, token_start=3, token_end=5, checksum="crc32:00000002", compressed_nbytes=1)]},
            "tile the tokens contiguously",
        ),
        ({"request_id": "../etc"}, "request_id"),
        ({"dtype": "int8"}, "dtype"),
    ],
)
def test_inconsistent_manifest_is_rejected(changes: dict, rule: str) -> None:
    with pytest.raises(ValidationError, match=rule.replace("(", r"\(").replace(")", r"\)")):
        Manifest.model_validate(_manifest(**changes), strict=False)


def test_ready_event_paths_stay_inside_the_dataset() -> None:
    fields = dict(
        event_id=ready_event_id("ds", "r-1"),
        request_id="r-1",
        tensors=TensorNames(hidden_states="r-1/hidden_states", token_ids="r-1/token_ids"),
        num_tokens=5,
        layer_ids=[1],
        dtype=DType.FLOAT32,
        hidden_size=8,
        model="tiny",
        checksum="crc32:00000001",
    )
    assert HiddenStatesReady(shard="shards/p0-000.safetensors", **fields).shard == "shards/p0-000.safetensors"
    for bad in ("/etc/passwd", "../x.safetensors", "shards/../../x", "", "a\\b"):
        with pytest.raises(ValidationError, match="relative POSIX path"):
            HiddenStatesReady(shard=bad, **fields)


def test_ready_event_id_is_deterministic() -> None:
    assert ready_event_id("ds", "r-1") == ready_event_id("ds", "r-1")
    assert len({ready_event_id("ds", "r-1"), ready_event_id("ds", "r-2"), ready_event_id("other", "r-1")}) == 3


def test_dlq_headers_round_trip_and_truncate() -> None:
    headers = DlqHeaders.build("invalid_event", "x" * 5000, service="extractor", source_topic="prompts",
                               source_partition=1, source_offset=42)
    assert len(headers.error_message) == 2000 and headers.error_message.endswith("...")
    kafka = dict(headers.to_kafka())
    assert kafka["hsx-source-offset"] == b"42" and kafka["hsx-error-class"] == b"invalid_event"
    assert DlqHeaders.from_kafka(list(kafka.items())) == headers
