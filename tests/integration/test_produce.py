"""``hsx produce`` against a real broker: nothing lost, nothing doubled, keys and
bytes intact, invalid lines handled by policy, ids stable across re-publishing,
Parquet publishing what JSONL does, ids to skip skipped."""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest

from hsx.cli import main
from hsx.local.topics import fresh_topic_settings
from hsx.producer.inputs import InputSpec, read_input
from hsx.producer.publisher import Publisher
from hsx.runtime.kafka import RecordProducer, ensure_topics
from hsx.runtime.settings import KafkaSettings, TopicSettings
from hsx.schemas import DlqHeaders, PromptEvent
from tests.drain import drain
from tests.unit.input_files import CHAT_MAPPING, chat_rows, write_jsonl, write_parquet

pytestmark = pytest.mark.integration


def _write_events(path: Path, n: int) -> list[dict]:
    events = []
    for i in range(n):
        if i % 3 == 0:
            event = {"request_id": f"rt-{i}", "prompt": f"Prompt number {i} ✓", "metadata": {"i": i}}
        elif i % 3 == 1:
            event = {"request_id": f"rt-{i}", "token_ids": list(range(i % 50 + 1))}
        else:
            event = {"request_id": f"rt-{i}", "messages": [{"role": "user", "content": f"q{i}"},
                                                            {"role": "assistant", "content": f"a{i}"}]}
        events.append(event)
    path.write_bytes(b"".join(orjson.dumps(e) + b"\n" for e in events))
    return events


def _produce(kafka: KafkaSettings, topics: TopicSettings, *args: str) -> int:
    return main(["produce", *args, "--bootstrap", kafka.bootstrap, "--topic", topics.prompts,
                 "--dlq-topic", topics.prompts_dlq, "--no-progress"])


def test_thousand_events_round_trip(tmp_path: Path, kafka: KafkaSettings, topic_settings: TopicSettings) -> None:
    path = tmp_path / "events.jsonl"
    sent = _write_events(path, 1000)
    assert _produce(kafka, topic_settings, str(path)) == 0

    records = drain(kafka, topic_settings.prompts, expected=1000)
    assert len(records) == 1000, "lost or doubled records"
    by_key = {r.key(): r for r in records}
    assert len(by_key) == 1000
    for event in sent:
        record = by_key[event["request_id"].encode()]
        received = PromptEvent.model_validate_json(record.value())
        assert received == PromptEvent.model_validate(event, strict=False)
        assert orjson.loads(record.value()) == {"schema_version": 1, **event}  # bytes carry exactly the event
    assert len({r.partition() for r in records}) > 1  # keys spread over the partitions


def test_republishing_a_file_reuses_generated_ids(tmp_path: Path, kafka: KafkaSettings, topic_settings: TopicSettings) -> None:
    path = tmp_path / "texts.jsonl"
    path.write_text("\n".join(orjson.dumps({"text": f"line {i}", "src": "t"}).decode() for i in range(20)))
    args = [str(path), "--format", "text", "--metadata-fields", "src"]
    assert _produce(kafka, topic_settings, *args) == 0
    assert _produce(kafka, topic_settings, *args) == 0
    records = drain(kafka, topic_settings.prompts, expected=40)
    ids = [PromptEvent.model_validate_json(r.value()).request_id for r in records]
    assert len(ids) == 40 and len(set(ids)) == 20
    # Keyed by request id: both copies of an id land in the same partition.
    assert len({(r.key(), r.partition()) for r in records}) == 20
    assert all(i.startswith("texts.jsonl:") for i in ids)


def test_invalid_lines_go_to_dlq_with_reasons(tmp_path: Path, kafka: KafkaSettings, topic_settings: TopicSettings) -> None:
    path = tmp_path / "mixed.jsonl"
    bad_lines = [b"{oops", orjson.dumps({"request_id": "", "prompt": "x"}),  # any id but an empty one
                 orjson.dumps({"request_id": "ok-2", "token_ids": [-4]})]
    good = [orjson.dumps({"request_id": f"ok-{i}", "prompt": "fine"}) for i in (1, 3)]
    path.write_bytes(b"\n".join([good[0], bad_lines[0], bad_lines[1], good[1], bad_lines[2]]) + b"\n")

    assert _produce(kafka, topic_settings, str(path), "--on-invalid", "dlq") == 0

    assert sorted(r.key() for r in drain(kafka, topic_settings.prompts, expected=2)) == [b"ok-1", b"ok-3"]
    dead = drain(kafka, topic_settings.prompts_dlq, expected=3)
    assert sorted(r.value() for r in dead) == sorted(bad_lines)  # original bytes, untouched
    reasons = {DlqHeaders.from_kafka(r.headers()).source_line: DlqHeaders.from_kafka(r.headers()) for r in dead}
    assert reasons[2].error_class == "invalid_json"
    assert reasons[3].error_class == "invalid_event" and "request_id" in reasons[3].error_message
    assert "token_ids.0" in reasons[5].error_message and reasons[5].source_file == "mixed.jsonl"


def test_fail_policy_stops_with_nonzero_exit(tmp_path: Path, kafka: KafkaSettings, topic_settings: TopicSettings) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_bytes(b'{"request_id": "a", "prompt": "x"}\n{"request_id": "b"}\n{"request_id": "c", "prompt": "y"}\n')
    assert _produce(kafka, topic_settings, str(path), "--on-invalid", "fail") == 1
    assert [r.key() for r in drain(kafka, topic_settings.prompts, expected=1, settle=2.0)] == [b"a"]


def test_missing_file_is_a_clear_error(tmp_path: Path, kafka: KafkaSettings, topic_settings: TopicSettings,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    assert _produce(kafka, topic_settings, str(tmp_path / "nope.jsonl")) == 2
    stderr = capsys.readouterr().err
    assert "cannot read" in stderr and "nope.jsonl" in stderr


def test_parquet_publishes_what_jsonl_does(tmp_path: Path, kafka: KafkaSettings, topic_settings: TopicSettings) -> None:
    rows = chat_rows(40)
    args = ["--format", "sharegpt", "--id-field", "uid", "--metadata-fields", "lang,score"]
    jsonl_topics = fresh_topic_settings()
    assert _produce(kafka, jsonl_topics, str(write_jsonl(rows, tmp_path / "chats.jsonl")), *args) == 0
    assert _produce(kafka, topic_settings, str(write_parquet(rows, tmp_path / "chats.parquet")), *args) == 0
    from_jsonl, from_parquet = ({r.key(): r.value() for r in drain(kafka, topics.prompts, expected=40)}
                                for topics in (jsonl_topics, topic_settings))
    assert len(from_parquet) == 40 and from_parquet == from_jsonl  # same keys, same bytes


def test_skip_ids_are_not_published(tmp_path: Path, kafka: KafkaSettings, topic_settings: TopicSettings) -> None:
    topics = topic_settings.topics()
    ensure_topics(kafka, topic_settings, [topics.prompts, topics.prompts_dlq])
    publisher = Publisher(RecordProducer.connect(kafka, "producer"), topics, CHAT_MAPPING)
    sent: list[str] = []
    lines = read_input(InputSpec(str(write_parquet(chat_rows(10), tmp_path / "chats.parquet"))))
    summary = publisher.publish(lines, skip_ids={"c-0", "c-7"}, on_sent=lambda e: sent.append(e.request_id))
    assert (summary.sent, summary.skipped) == (8, 2)
    keys = sorted(r.key().decode() for r in drain(kafka, topics.prompts, expected=8))
    assert keys == sorted(sent) == sorted(f"c-{i}" for i in range(10) if i not in (0, 7))
