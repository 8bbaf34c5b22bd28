"""Fault-test tools: the services' command lines for these tests, records as
any client could publish them, the checks every fault test ends with, and the
figures the README quotes. The services run as :class:`hsx.local.spawn.HsxService`
processes on :func:`hsx.local.topics.fresh_topics`."""

from __future__ import annotations

import fcntl
import time
from collections import Counter
from collections.abc import Callable, Iterable
from pathlib import Path

import orjson
from confluent_kafka import Consumer, Message, Producer, TopicPartition

from hsx.local.commands import extract_command, sink_command
from tests.drain import drain
from hsx.dataset.index import read_indexes
from hsx.dataset.storage import is_object_store, open_storage
from hsx.runtime.settings import KafkaSettings, TopicSettings
from hsx.schemas import DlqHeaders, HiddenStatesReady
from hsx.sink.assembler import Record

FIGURES = Path(__file__).resolve().parents[2] / "out" / "reliability.json"


def extract_args(kafka: KafkaSettings, topics: TopicSettings, model: Path, group: str) -> list[str]:
    """The fault tests' extractor: prompts of up to 512 tokens."""
    return extract_command(kafka.bootstrap, topics, model, "--max-model-len", "512", group=group)


def sink_args(kafka: KafkaSettings, topics: TopicSettings, output: str | Path, group: str) -> list[str]:
    """The fault tests' sink: small shards, closed every second, so kills land among shard writes."""
    return sink_command(kafka.bootstrap, topics, output, "--max-shard-samples", "8", "--max-shard-age", "1",
                        group=group)


def publish(kafka: KafkaSettings, topic: str, records: Iterable[tuple[bytes | None, bytes | None]]
            | Iterable[Record]) -> int:
    """Raw records, (key, value) pairs or assembler Records with headers, as any
    client could send them; returns how many."""
    producer = Producer({"bootstrap.servers": kafka.bootstrap, "message.max.bytes": 16 << 20})
    count = 0
    for record in records:
        if isinstance(record, Record):
            producer.produce(topic, key=record.key, value=record.value, headers=record.headers)
        else:
            producer.produce(topic, key=record[0], value=record[1])
        count += 1
    assert producer.flush(60) == 0
    return count


def text_prompts(count: int, prefix: str) -> list[dict[str, object]]:
    """Distinct prompts of varied length (about 10 to 100 tokens)."""
    return [{"request_id": f"{prefix}-{i}", "prompt": " ".join(f"w{(i * 31 + k) % 211}" for k in range(3 + i * 7 % 29))}
            for i in range(count)]


def as_records(prompts: list[dict[str, object]]) -> list[tuple[bytes, bytes]]:
    return [(str(p["request_id"]).encode(), orjson.dumps(p)) for p in prompts]


def index_counts(output: str | Path) -> Counter[str]:
    """How often each request id appears in the dataset's shard indexes (a
    duplicate shows as 2, which ``open_dataset`` would hide); ``output`` a
    directory or an ``s3://`` URL."""
    if not is_object_store(output) and not Path(output).exists():
        return Counter()
    return Counter(e.request_id for index in read_indexes(open_storage(output)) for e in index.events)


def wait_until(condition: Callable[[], bool], timeout: float, what: str, tick: Callable[[], None] = lambda: None) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")
        tick()
        time.sleep(0.5)


def dead_letters(kafka: KafkaSettings, topic: str, expected: int, timeout: float = 30) -> list[tuple[DlqHeaders, Message]]:
    return [(DlqHeaders.from_kafka(r.headers()), r) for r in drain(kafka, topic, expected, timeout=timeout, settle=2.0)]


def committed(kafka: KafkaSettings, topic: str, group: str, partitions: int) -> dict[int, int]:
    consumer = Consumer({"bootstrap.servers": kafka.bootstrap, "group.id": group})
    try:
        tps = consumer.committed([TopicPartition(topic, p) for p in range(partitions)], timeout=10)
        return {tp.partition: tp.offset for tp in tps}
    finally:
        consumer.close()


def record_figures(test: str, figures: dict[str, object]) -> None:
    """Merge one test's figures into ``out/reliability.json`` (quoted in the README)
    and print them into the test's output. Two xdist workers may both merge: the
    read-modify-write holds a lock."""
    FIGURES.parent.mkdir(parents=True, exist_ok=True)
    with open(FIGURES.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        current = orjson.loads(FIGURES.read_bytes()) if FIGURES.exists() else {}
        current[test] = figures
        FIGURES.write_bytes(orjson.dumps(current, option=orjson.OPT_INDENT_2 | orjson.OPT_SORT_KEYS))
    print(f"{test}: {orjson.dumps(figures).decode()}")


def check_exactly_once(kafka: KafkaSettings, topics: TopicSettings, output: str | Path, ids: set[str]) -> None:
    """The end state every fault test demands: each prompt once in the dataset,
    no valid prompt dead-lettered, only a killed extractor's partial attempts
    (of prompts that made it anyway) reported by the sink, and every sample
    announced under one deterministic event id."""
    counts = index_counts(output)
    assert set(counts) == ids, f"lost: {sorted(ids - set(counts))[:5]}, unknown: {sorted(set(counts) - ids)[:5]}"
    assert max(counts.values()) == 1, f"doubled: {[k for k, v in counts.items() if v > 1][:5]}"
    assert drain(kafka, topics.prompts_dlq, expected=0, timeout=5, settle=3) == []
    for headers, record in dead_letters(kafka, topics.blocks_dlq, expected=0, timeout=5):
        assert headers.error_class in {"superseded_attempt", "incomplete_sample"}, headers
        assert record.key().decode() in ids
    ready = [HiddenStatesReady.model_validate_json(r.value()) for r in drain(kafka, topics.ready, expected=len(ids))]
    assert {e.request_id for e in ready} == ids
    assert len({e.event_id for e in ready}) == len(ids)
