"""Fault-test tools: the services as real, killable processes with their
operations endpoint, the checks every fault test ends with, and the figures the
README quotes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

import orjson
import psutil
from confluent_kafka import Consumer, Message, Producer, TopicPartition

from hsx.demo import cpu_engine_env
from runtime.broker import free_port
from runtime.kafka import ensure_topics
from runtime.kafka.drain import drain
from runtime.settings import KafkaSettings, TopicSettings
from schemas import DlqHeaders, HiddenStatesReady
from sink.assembler import Record
from sink.shards import read_indexes
from sink.storage import LocalStorage
from tests.http_helpers import get, metric, metric_sum

FIGURES = Path(__file__).resolve().parents[2] / "out" / "reliability.json"


def fresh_topics(kafka: KafkaSettings, partitions: int = 2) -> TopicSettings:
    """All five topics, unique to one test, created."""
    suffix = uuid.uuid4().hex[:8]
    topics = TopicSettings(prompts=f"p-{suffix}", prompts_dlq=f"pd-{suffix}", blocks=f"b-{suffix}",
                           blocks_dlq=f"bd-{suffix}", ready=f"r-{suffix}", partitions=partitions)
    t = topics.topics()
    ensure_topics(kafka, topics, [t.prompts, t.prompts_dlq, t.blocks, t.blocks_dlq, t.ready])
    return topics


def extract_args(kafka: KafkaSettings, topics: TopicSettings, model: Path, group: str) -> list[str]:
    return ["extract", "--bootstrap", kafka.bootstrap, "--topic", topics.prompts, "--blocks-topic", topics.blocks,
            "--dlq-topic", topics.prompts_dlq, "--group", group, "--model", str(model), "--dtype", "float32",
            "--enforce-eager", "--max-model-len", "512", "--session-timeout-ms", "6000"]


def sink_args(kafka: KafkaSettings, topics: TopicSettings, output: Path, group: str) -> list[str]:
    return ["sink", "--bootstrap", kafka.bootstrap, "--output", str(output), "--topic", topics.blocks,
            "--ready-topic", topics.ready, "--dlq-topic", topics.blocks_dlq, "--group", group,
            "--session-timeout-ms", "6000", "--max-shard-samples", "8", "--max-shard-age", "1"]


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


@dataclass
class Service:
    """One ``hsx`` service as a restartable process group with its own
    ``--health-port``; each incarnation logs to its own file."""

    name: str
    args: list[str]
    log_dir: Path
    env: dict[str, str] = field(default_factory=cpu_engine_env)
    incarnations: int = 0
    proc: subprocess.Popen[bytes] | None = None
    port: int = 0

    def start(self) -> Service:
        self.port = free_port()
        self.incarnations += 1
        log = (self.log_dir / f"{self.name}-{self.incarnations}.log").open("wb")
        # A session of its own, so a kill takes vLLM's engine processes with it,
        # as when a pod or machine dies.
        self.proc = subprocess.Popen([sys.executable, "-m", "hsx.cli", *self.args, "--health-port", str(self.port)],
                                     stdout=log, stderr=subprocess.STDOUT, env=self.env, start_new_session=True)
        log.close()
        return self

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def exited(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def ready(self) -> bool:
        try:
            return get(self.port, "/readyz")[0] == 200
        except OSError:
            return False

    def wait_ready(self, timeout: float = 300) -> None:
        deadline = time.monotonic() + timeout
        while not self.ready():
            if self.exited() is not None:
                raise AssertionError(f"{self.name} exited with {self.exited()}:\n{self.log_tail()}")
            if time.monotonic() > deadline:
                raise AssertionError(f"{self.name} not ready after {timeout}s:\n{self.log_tail()}")
            time.sleep(0.2)

    def metric(self, name: str, labelled: bool = False) -> float:
        """An unlabelled series, or the sum of a labelled one; NaN when the
        process does not answer."""
        try:
            return (metric_sum if labelled else metric)(self.port, name)
        except (OSError, StopIteration):
            return float("nan")

    def kill(self) -> None:
        """SIGKILL the whole process group, no warning, no cleanup."""
        os.killpg(self.pid, signal.SIGKILL)
        assert self.proc is not None
        self.proc.wait(30)

    def signal(self, sig: signal.Signals) -> None:
        os.killpg(self.pid, sig)

    def stop(self, timeout: float = 120) -> int:
        """SIGTERM (a drain) and wait; returns the exit status."""
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"{self.name} did not drain within {timeout}s:\n{self.log_tail()}") from None

    def _tree(self) -> list[psutil.Process]:
        try:
            root = psutil.Process(self.pid)
            return [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return []

    def rss_bytes(self) -> int:
        """Resident memory of the process tree (vLLM's engine runs in children)."""
        total = 0
        for proc in self._tree():
            try:
                total += proc.memory_info().rss
            except psutil.NoSuchProcess:
                continue
        return total

    def child(self, name: str) -> int:
        """The pid of the tree's process named ``name`` (e.g. ``VLLM::Worker``)."""
        for proc in self._tree():
            try:
                if proc.name() == name[:15]:  # the kernel keeps 15 characters of it
                    return proc.pid
            except psutil.NoSuchProcess:
                continue
        raise AssertionError(f"no process {name} under {self.name}")

    def log_tail(self, chars: int = 3000) -> str:
        path = self.log_dir / f"{self.name}-{self.incarnations}.log"
        return path.read_text(errors="replace")[-chars:] if path.exists() else ""

    def logs(self) -> str:
        return "".join(p.read_text(errors="replace") for p in sorted(self.log_dir.glob(f"{self.name}-*.log")))

    def __enter__(self) -> Service:
        return self.start()

    def __exit__(self, *_: object) -> None:
        if self.exited() is None:
            self.kill()


def index_counts(output: Path) -> Counter[str]:
    """How often each request id appears in the dataset's shard indexes (a
    duplicate shows as 2, which ``open_dataset`` would hide)."""
    if not output.exists():
        return Counter()
    return Counter(e.request_id for index in read_indexes(LocalStorage(output)) for e in index.events)


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
    and print them into the test's output."""
    FIGURES.parent.mkdir(parents=True, exist_ok=True)
    current = orjson.loads(FIGURES.read_bytes()) if FIGURES.exists() else {}
    current[test] = figures
    FIGURES.write_bytes(orjson.dumps(current, option=orjson.OPT_INDENT_2 | orjson.OPT_SORT_KEYS))
    print(f"{test}: {orjson.dumps(figures).decode()}")


def check_exactly_once(kafka: KafkaSettings, topics: TopicSettings, output: Path, ids: set[str]) -> None:
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
