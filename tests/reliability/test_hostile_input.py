"""Hostile input: over fifty kinds of malformed or hostile prompt records,
interleaved with valid ones, through one extractor and one sink that never
restart. Every bad record lands in a DLQ with its reason, every good one in the
dataset exactly once, and no secret from the configuration shows anywhere."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

import orjson
import pytest

from hsx import models
from hsx.local.spawn import HsxService
from hsx.local.topics import fresh_topics
from tests.drain import drain
from hsx.dataset.reader import open_dataset
from hsx.runtime.settings import KafkaSettings
from tests.reliability.harness import dead_letters, extract_args, index_counts, publish, record_figures, sink_args
from tests.unit.test_prompt_event import INVALID, SMALL, data_uri

pytestmark = [pytest.mark.integration, pytest.mark.engine, pytest.mark.faults]

MODEL = "smollm2-135m-instruct"
SECRET = "hsx-test-secret-7f3a9c"

# (kind, value, DLQ error class) beyond the schema cases shared with the unit tests.
ENGINE_AND_WIRE = [
    ("empty-value", b"", "invalid_event"),
    ("tombstone", None, "invalid_event"),
    ("nan-literal", b'{"request_id":"h-nan","prompt":NaN}', "invalid_event"),
    ("utf8-bom", b'\xef\xbb\xbf{"request_id":"h-bom","prompt":"hi"}', "invalid_event"),
    ("oversize-message", orjson.dumps({"request_id": "h-big", "prompt": "x" * (2 << 20)}), "invalid_event"),
    ("token-out-of-vocabulary", orjson.dumps({"request_id": "h-oov", "token_ids": [1, 2, 900_000]}),
     "token_out_of_vocabulary"),
    ("token-id-int32-max", orjson.dumps({"request_id": "h-max", "token_ids": [2**31 - 1]}), "token_out_of_vocabulary"),
    # A valid chat with an image: the extractor cannot run it yet, and says which part.
    ("image-prompt", orjson.dumps({"request_id": "h-img", "messages": [{"role": "user", "content": [
        {"type": "text", "text": "What is in it?"}, {"type": "image_url", "image_url": {"url": data_uri()}}]}]}),
     "images_unsupported"),
    # 100 characters (within the event limits) that tokenize into more than --max-model-len tokens.
    ("too-long-for-the-model", orjson.dumps({"request_id": "h-long", "prompt": "\U0001d518" * 100}), "prompt_too_long"),
]


def good_prompts() -> list[dict[str, object]]:
    """Valid under the SMALL limits: short texts, a few token ids, short chats."""
    out: list[dict[str, object]] = []
    for i in range(8):
        out.append({"request_id": f"good-text-{i}", "prompt": f"Tell me about the number {i} in one line."})
        out.append({"request_id": f"good-ids-{i}", "token_ids": [1 + i, 200 + i, 3000 + i, 40 + i]})
        out.append({"request_id": f"good-chat-{i}", "messages": [
            {"role": "user", "content": f"What is {i} plus {i}?"}, {"role": "assistant", "content": f"It is {2 * i}."}]})
    return out


def test_hostile_records_go_to_the_dlq_and_good_ones_to_the_dataset(kafka: KafkaSettings, tmp_path: Path) -> None:
    model = models.prepare(names=[MODEL])[MODEL]
    topics = fresh_topics(kafka, partitions=1)  # one partition: DLQ records map back by offset
    good = good_prompts()
    bad = [(kind, value, "invalid_event", (loc, rule)) for kind, value, loc, rule in INVALID]
    bad += [(kind, value, error_class, None) for kind, value, error_class in ENGINE_AND_WIRE]
    replay = good[0]  # the same id and content again: a replay, de-duplicated, not an error
    conflicting = {"request_id": good[1]["request_id"], "prompt": "A different prompt under a taken id."}

    records: list[tuple[bytes | None, bytes | None]] = []
    expected: dict[int, tuple[str, str, tuple[str, str] | None]] = {}  # offset -> (kind, class, (loc, rule))
    for i in range(max(len(good), len(bad))):
        if i < len(bad):
            kind, value, error_class, fields = bad[i]
            expected[len(records)] = (kind, error_class, fields)
            records.append((kind.encode(), value))
        if i < len(good):
            records.append((str(good[i]["request_id"]).encode(), orjson.dumps(good[i])))
    records += [(b"replay", orjson.dumps(replay)), (b"conflict", orjson.dumps(conflicting))]
    publish(kafka, topics.prompts, records)

    env = {f"HSX_PROMPT_{name.upper()}": str(value) for name, value in asdict(SMALL).items()}
    env |= {"HSX_KAFKA_SASL_USERNAME": "hsx", "HSX_KAFKA_SASL_PASSWORD": SECRET,
            "HSX_KAFKA_CLIENT_PROPERTIES": orjson.dumps({"ssl.keystore.password": SECRET + "-ks"}).decode()}
    output = tmp_path / "dataset"
    extractor = HsxService("extractor", extract_args(kafka, topics, model, "x-hostile") + ["--max-model-len", "128",
                           "--exit-when-idle", "8"], tmp_path)
    extractor.env |= env
    sink = HsxService("sink", sink_args(kafka, topics, output, "s-hostile") + ["--exit-when-idle", "6"], tmp_path)
    sink.env |= env
    for service in (extractor, sink):  # one process each, never restarted
        with service:
            assert service.proc is not None and service.proc.wait(600) == 0, service.log_tail()

    letters = dead_letters(kafka, topics.prompts_dlq, expected=len(bad))
    by_offset = {h.source_offset: (h, r) for h, r in letters}
    assert len(letters) == len(bad) and set(by_offset) == set(expected)
    for offset, (kind, error_class, fields) in expected.items():
        headers, record = by_offset[offset]
        assert headers.error_class == error_class, (kind, headers)
        assert record.value() == records[offset][1] or (record.value() is None and records[offset][1] is None), kind
        if fields is not None:
            loc, rule = fields
            assert f"{loc}: " in headers.error_message and rule in headers.error_message, (kind, headers.error_message)

    ((conflict_headers, conflict_record),) = dead_letters(kafka, topics.blocks_dlq, expected=1)
    assert conflict_headers.error_class == "conflicting_duplicate"
    dataset = open_dataset(output)
    kept = dataset[str(conflicting["request_id"])]["token_ids"].tolist()
    assert orjson.loads(conflict_record.value())["token_ids"] != kept  # the DLQ holds the other one

    assert index_counts(output) == {str(p["request_id"]): 1 for p in good}
    everything = extractor.logs() + sink.logs() + "".join(
        repr((r.value(), r.headers())) for r in drain(kafka, topics.prompts_dlq, expected=len(bad))
        + drain(kafka, topics.blocks_dlq, expected=1))
    assert SECRET not in everything
    record_figures("hostile_input", {
        "hostile_kinds": len(bad) + 2, "dead_lettered": len(letters) + 1, "replays_deduplicated": 1,
        "good_prompts": len(good), "in_dataset": len(dataset), "service_restarts": 0, "secret_found_in_output": False,
    })
