"""Corrupt block records, interleaved with good samples, through a real sink:
none reaches the dataset, each is reported in the blocks DLQ with its class."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import orjson
import pytest

from hsx.local.spawn import HsxService
from hsx.local.topics import fresh_topics
from hsx.runtime.settings import KafkaSettings
from hsx.sink.assembler import Record
from tests.reliability.harness import dead_letters, index_counts, publish, record_figures, sink_args
from tests.unit.test_assembler import HIDDEN, records

pytestmark = [pytest.mark.integration]


def _with(record: Record, value: bytes) -> Record:
    return Record(record.offset, record.key, value, record.headers)


def _flip(recs: list[Record]) -> list[Record]:
    value = bytearray(recs[1].value)
    value[-5] ^= 0xFF
    return [recs[0], _with(recs[1], bytes(value)), *recs[2:]]


def _manifest(change: Callable[[dict], dict]) -> Callable[[list[Record]], list[Record]]:  # type: ignore[type-arg]
    return lambda recs: [*recs[:-1], _with(recs[-1], orjson.dumps(change(orjson.loads(recs[-1].value))))]


# (request id, how its records are damaged, the DLQ class expected)
DAMAGE: list[tuple[str, Callable[[list[Record]], list[Record]], str]] = [
    ("flipped-byte", _flip, "corrupt_block"),
    ("truncated-block", lambda r: [_with(r[0], r[0].value[:-10]), *r[1:]], "corrupt_block"),
    ("manifest-without-blocks", lambda r: [r[-1]], "incomplete_sample"),
    ("blocks-without-manifest", lambda r: r[:-1], "incomplete_sample"),
    ("missing-middle-block", lambda r: [r[0], *r[2:]], "incomplete_sample"),
    ("wrong-shape", _manifest(lambda m: {**m, "hidden_size": HIDDEN * 2}), "shape_mismatch"),
    ("wrong-token-count", _manifest(lambda m: {**m, "num_tokens": 99}), "invalid_manifest"),
    ("manifest-of-another-request", _manifest(lambda m: {**m, "request_id": "someone-else"}), "invalid_manifest"),
    ("path-traversal-id", _manifest(lambda m: {**m, "request_id": "../../etc"}), "invalid_manifest"),
    ("garbage-manifest", lambda r: [*r[:-1], _with(r[-1], b"\x00not json")], "invalid_manifest"),
    ("unreadable-headers", lambda r: [Record(0, r[0].key, r[0].value, [("kind", b"mystery")])], "invalid_record"),
]


def test_corrupt_records_never_reach_the_dataset(kafka: KafkaSettings, tmp_path: Path) -> None:
    topics = fresh_topics(kafka, partitions=1)
    stream: list[Record] = []
    good = [f"good-{i}" for i in range(6)]
    for i, (request_id, damage, _) in enumerate(DAMAGE):
        stream += damage(records(request_id)[0])
        if i < len(good):
            stream += records(good[i])[0]
    publish(kafka, topics.blocks, stream)

    output = tmp_path / "dataset"
    sink = HsxService("sink", sink_args(kafka, topics, output, "s-corrupt") + [
        "--incomplete-timeout", "3", "--exit-when-idle", "8"], tmp_path)
    with sink:
        assert sink.proc is not None and sink.proc.wait(120) == 0, sink.log_tail()

    assert index_counts(output) == {request_id: 1 for request_id in good}
    letters = dead_letters(kafka, topics.blocks_dlq, expected=len(DAMAGE))
    reported = {(r.key() or b"").decode(): h.error_class for h, r in letters}
    unreadable = next(r for h, r in letters if h.error_class == "invalid_record")
    assert unreadable.value() == next(r.value for r in stream if r.headers == [("kind", b"mystery")])  # kept whole
    assert len(letters) == len(DAMAGE)
    assert reported == {request_id: error_class for request_id, _, error_class in DAMAGE}
    record_figures("corrupt_records", {"kinds": len(DAMAGE), "reported": len(letters), "in_dataset": len(good)})
