"""The connector's sending half without vLLM: blocks of whole tokens, then the
manifest, bit-exact on the wire; finished only after Kafka's acks; failures
reported, never swallowed; a record Kafka refuses reported as such (fatal for
the extractor); a full local queue never deadlocks."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterable
from pathlib import Path

import pytest
import torch
import zmq
from confluent_kafka import Message

from hsx.dataset.storage import open_storage
from hsx.extractor.completion import CompletionSender
from hsx.extractor.connector.gather import gather_cpu
from hsx.extractor.connector.metadata import SendJob
from hsx.extractor.connector.sender import BlockSender
from hsx.local.broker import free_port
from hsx.local.topics import fresh_topic_settings
from hsx.runtime.kafka import RecordProducer, ensure_topics
from hsx.runtime.settings import KafkaSettings, TopicSettings
from hsx.schemas import BlockRecordHeaders, Codec, RecordKind, staged_key
from hsx.schemas.connector import ConnectorConfig, RequestParams
from hsx.schemas.reports import CompletionReport
from tests.engine_helpers import reassemble
from tests.drain import drain

pytestmark = pytest.mark.integration

LAYERS, HIDDEN, BLOCK_SIZE = 3, 64, 16


@pytest.fixture
def completions(tmp_path: Path):  # type: ignore[no-untyped-def]
    context = zmq.Context.instance()
    socket = context.socket(zmq.PULL)
    address = f"ipc://{tmp_path / 'c.sock'}"
    socket.bind(address)
    yield address, socket
    socket.close(linger=0)


def _config(address: str, topic: str, **fields: object) -> ConnectorConfig:
    """A connector config for a BlockSender given its Kafka settings directly (no
    settings file) and requests far below any budget."""
    return ConnectorConfig(completion_address=address, kafka_settings_file="unused", blocks_topic=topic, model="m",
                           max_request_bytes=1 << 20, **fields)  # type: ignore[arg-type]


def _job(request_id: str, tokens: int, cache: torch.Tensor) -> tuple[SendJob, torch.Tensor]:
    blocks = list(range(5, 5 + (tokens + BLOCK_SIZE - 1) // BLOCK_SIZE))[::-1]  # scattered, out of order
    params = RequestParams(request_id=request_id, attempt_id=uuid.uuid4().hex,
                           source={"topic": "prompts", "partition": 0, "offset": 7},  # type: ignore[arg-type]
                           loss_mask_spans=[(0, 1)], metadata={"m": 1})
    job = SendJob(f"{request_id}-abcd1234", blocks, list(range(tokens)), params.model_dump(mode="json"))
    expected = torch.stack([cache[blocks[t // BLOCK_SIZE], :, t % BLOCK_SIZE] for t in range(tokens)])
    return job, expected


def _receive(socket: zmq.Socket, timeout: float = 30.0) -> CompletionReport:
    assert socket.poll(int(timeout * 1000)), "no completion report"
    return CompletionReport.model_validate_json(socket.recv())


def _wait_finished(sender: BlockSender, expected: set[str], timeout: float = 30.0) -> set[str]:
    finished: set[str] = set()
    deadline = time.monotonic() + timeout
    while finished != expected and time.monotonic() < deadline:
        finished |= sender.take_finished()
        time.sleep(0.01)
    return finished


def _record_bytes(records: Iterable[Message]) -> int:
    """What the records weigh on the topic: keys, values and headers."""
    return sum(len(r.key() or b"") + len(r.value() or b"") + sum(len(k) + len(v or b"") for k, v in r.headers() or [])
               for r in records)


def _send_all(sender: BlockSender, jobs: dict, cache: torch.Tensor, socket) -> dict:  # type: ignore[no-untyped-def]
    """Submit every job, collect one report each (by request id), check vLLM may
    free every request's blocks, and close the sender."""
    try:
        for job, _ in jobs.values():
            sender.submit(job, gather_cpu(cache, job.block_ids, len(job.token_ids), BLOCK_SIZE))
        reports = {r.request_id: r for r in (_receive(socket) for _ in jobs)}
        engine_ids = {j.engine_request_id for j, _ in jobs.values()}
        assert _wait_finished(sender, engine_ids) == engine_ids
    finally:
        sender.close()
    return reports


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sends_bit_exact_blocks_then_manifest(dtype: torch.dtype, kafka: KafkaSettings, topic_settings: TopicSettings,
                                              completions) -> None:  # type: ignore[no-untyped-def]
    address, socket = completions
    ensure_topics(kafka, topic_settings, [topic_settings.blocks])
    cache = torch.randn(20, LAYERS, BLOCK_SIZE, HIDDEN).to(dtype)
    config = _config(address, topic_settings.blocks, block_bytes=4096, codec=Codec.BYTEPLANE_ZSTD)
    sender = BlockSender(config, kafka, [1, 2, 4], CompletionSender(address))
    jobs = {name: _job(name, tokens, cache) for name, tokens in (("one", 1), ("mid", 37), ("many", 70))}
    reports = _send_all(sender, jobs, cache, socket)
    assert all(r.ok and r.error is None for r in reports.values())
    on_topic = drain(kafka, topic_settings.blocks, expected=1, settle=2.0)
    samples = reassemble(on_topic)
    for name, (job, expected) in jobs.items():
        assert reports[name].kafka_bytes == _record_bytes(r for r in on_topic if r.key() == name.encode())
        (sample,) = samples[name]
        assert torch.equal(sample.hidden_states.view(torch.uint8), expected.contiguous().view(torch.uint8))
        row_bytes = LAYERS * HIDDEN * expected.element_size()
        assert len(sample.manifest.blocks) == -(-len(job.token_ids) // max(1, 4096 // row_bytes))
        assert sample.manifest.layer_ids == [1, 2, 4] and sample.manifest.loss_mask_spans == [(0, 1)]
        assert reports[name].num_tokens == len(job.token_ids)
        assert reports[name].raw_bytes == expected.numel() * expected.element_size()


@pytest.mark.parametrize("store", ["directory", "s3"])
def test_by_reference_stages_the_blocks_and_sends_only_the_manifest(
        store: str, kafka: KafkaSettings, topic_settings: TopicSettings, completions,  # type: ignore[no-untyped-def]
        tmp_path: Path, request: pytest.FixtureRequest) -> None:
    """``--payload-store``: one staged object per attempt, holding exactly the
    block records' values, and the manifest alone on the topic, once the object is durable."""
    address, socket = completions
    ensure_topics(kafka, topic_settings, [topic_settings.blocks])
    url = str(tmp_path / "staging") if store == "directory" else request.getfixturevalue("s3_dataset_url")
    cache = torch.randn(20, LAYERS, BLOCK_SIZE, HIDDEN).to(torch.bfloat16)
    config = _config(address, topic_settings.blocks, block_bytes=4096, payload_store=url)
    sender = BlockSender(config, kafka, [1, 2, 4], CompletionSender(address))
    jobs = {name: _job(name, tokens, cache) for name, tokens in (("one", 1), ("many", 70))}
    reports = _send_all(sender, jobs, cache, socket)
    assert all(r.ok and r.error is None for r in reports.values()), reports
    on_topic = drain(kafka, topic_settings.blocks, expected=2, settle=2.0)
    assert [BlockRecordHeaders.from_kafka(r.headers()).kind for r in on_topic] == [RecordKind.MANIFEST] * 2
    payloads = open_storage(url)
    samples = reassemble(on_topic, payloads)
    for name, (job, expected) in jobs.items():
        (sample,) = samples[name]
        assert torch.equal(sample.hidden_states.view(torch.uint8), expected.contiguous().view(torch.uint8))
        assert sample.manifest.payload is not None and len(sample.manifest.blocks) > (name == "many")
        assert payloads.size(sample.manifest.payload.key) == sample.manifest.payload.nbytes
        assert reports[name].compressed_bytes == sample.manifest.payload.nbytes
        assert reports[name].kafka_bytes == _record_bytes(r for r in on_topic if r.key() == name.encode())


def test_a_failed_staging_is_reported_and_sends_no_manifest(kafka: KafkaSettings, topic_settings: TopicSettings,
                                                             completions, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """The extractor retries such an attempt (not a refusal); the other attempts are unaffected."""
    address, socket = completions
    ensure_topics(kafka, topic_settings, [topic_settings.blocks])
    config = _config(address, topic_settings.blocks, block_bytes=4096, payload_store=str(tmp_path / "staging"))
    sender = BlockSender(config, kafka, [1, 2, 4], CompletionSender(address))
    cache = torch.randn(20, LAYERS, BLOCK_SIZE, HIDDEN)
    jobs = {name: _job(name, 37, cache) for name in ("broken", "fine")}
    params = jobs["broken"][0].params
    (tmp_path / "staging" / staged_key(params["request_id"], params["attempt_id"])).mkdir()  # the object cannot land
    reports = _send_all(sender, jobs, cache, socket)
    assert reports["fine"].ok, reports["fine"]
    broken = reports["broken"]
    assert not broken.ok and not broken.refused and "staging its blocks failed" in (broken.error or ""), broken
    on_topic = drain(kafka, topic_settings.blocks, expected=1, settle=2.0)
    assert [r.key() for r in on_topic] == [b"fine"]


def test_unreachable_kafka_is_reported_as_a_refusal(completions) -> None:  # type: ignore[no-untyped-def]
    address, socket = completions
    kafka = KafkaSettings(bootstrap=f"127.0.0.1:{free_port()}", client_properties={"message.timeout.ms": "1500"})
    config = _config(address, "nowhere")
    sender = BlockSender(config, kafka, [1], CompletionSender(address))
    cache = torch.randn(20, 1, BLOCK_SIZE, 8)
    job, _ = _job("lost", 5, cache)
    try:
        sender.submit(job, gather_cpu(cache, job.block_ids, 5, BLOCK_SIZE))
        report = _receive(socket)
        assert _wait_finished(sender, {job.engine_request_id}) == {job.engine_request_id}
    finally:
        sender.close(timeout=1)
    assert not report.ok and report.refused and "Message timed out" in (report.error or ""), report


def test_a_manifest_that_fails_its_checks_is_reported(kafka: KafkaSettings, topic_settings: TopicSettings,
                                                      completions) -> None:  # type: ignore[no-untyped-def]
    address, socket = completions
    ensure_topics(kafka, topic_settings, [topic_settings.blocks])
    # The report waits for the block's ack; it is a failure to retry, not a refusal.
    sender = BlockSender(_config(address, topic_settings.blocks), kafka, [1], CompletionSender(address))
    cache = torch.randn(20, 1, BLOCK_SIZE, 8)
    job, _ = _job("bad-span", 1, cache)
    job.params["loss_mask_spans"] = [[0, 5]]  # beyond the request's single token
    try:
        sender.submit(job, gather_cpu(cache, job.block_ids, 1, BLOCK_SIZE))
        report = _receive(socket)
    finally:
        sender.close(timeout=5)
    assert not report.ok and not report.refused and "loss mask span" in (report.error or ""), report


def test_records_the_broker_refuses_are_reported_as_refused(kafka_bootstrap: str,
                                                            completions) -> None:  # type: ignore[no-untyped-def]
    address, socket = completions
    # A topic that does not exist, and the producer may not create it: the broker
    # answers "unknown topic" until librdkafka gives up (after 1 s, not 30).
    kafka = KafkaSettings(bootstrap=kafka_bootstrap, client_properties={
        "allow.auto.create.topics": "false", "topic.metadata.propagation.max.ms": "1000"})
    sender = BlockSender(_config(address, fresh_topic_settings().blocks, block_bytes=4096), kafka, [1, 2, 4],
                         CompletionSender(address))
    cache = torch.randn(20, LAYERS, BLOCK_SIZE, HIDDEN)
    job, _ = _job("refused", 37, cache)
    try:
        sender.submit(job, gather_cpu(cache, job.block_ids, len(job.token_ids), BLOCK_SIZE))
        report = _receive(socket)
        # vLLM may free the request's blocks: nothing of it is outstanding any more.
        assert _wait_finished(sender, {job.engine_request_id}) == {job.engine_request_id}
    finally:
        sender.close(timeout=5)
    assert not report.ok and report.refused, report
    assert "Kafka refused a record" in (report.error or "") and "Unknown topic" in (report.error or ""), report


def test_a_full_local_queue_stalls_transfers_without_deadlock(kafka: KafkaSettings, topic_settings: TopicSettings,
                                                              completions,  # type: ignore[no-untyped-def]
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    address, socket = completions
    ensure_topics(kafka, topic_settings, [topic_settings.blocks])
    full = []
    produce = RecordProducer.produce

    def counting(self: RecordProducer, *args: object, **kwargs: object) -> bool:
        queued = produce(self, *args, **kwargs)  # type: ignore[arg-type]
        full.append(not queued)
        return queued

    monkeypatch.setattr(RecordProducer, "produce", counting)
    # Room for two records in librdkafka's queue: almost every produce finds it full.
    tiny_queue = kafka.model_copy(update={"client_properties": {"queue.buffering.max.messages": "2"}})
    sender = BlockSender(_config(address, topic_settings.blocks, block_bytes=4096, compress_threads=4), tiny_queue,
                         [1, 2, 4], CompletionSender(address))
    cache = torch.randn(20, LAYERS, BLOCK_SIZE, HIDDEN)
    jobs = {name: _job(name, tokens, cache) for name, tokens in (("long", 70), ("mid", 37), ("short", 9))}
    reports = _send_all(sender, jobs, cache, socket)
    assert all(r.ok and not r.refused for r in reports.values()), reports
    assert any(full), "the queue was never full: the test did not exercise a stall"
    tokens_per_block = 4096 // (LAYERS * HIDDEN * 4)
    blocks = {name: -(-len(job.token_ids) // tokens_per_block) for name, (job, _) in jobs.items()}
    records = drain(kafka, topic_settings.blocks, expected=sum(blocks.values()) + len(jobs))
    order: dict[str, list[int | None]] = {}
    for record in records:  # a request's records share a partition: this is their order in the log
        headers = BlockRecordHeaders.from_kafka(record.headers())
        order.setdefault(record.key().decode(), []).append(
            None if headers.kind is RecordKind.MANIFEST else headers.block_index)
    assert order == {name: [*range(count), None] for name, count in blocks.items()}  # blocks in order, then the manifest
    samples = reassemble(records)
    for name, (_, expected) in jobs.items():
        assert torch.equal(samples[name][0].hidden_states, expected)


def test_in_flight_budget_admits_one_oversized_request() -> None:
    config = _config("ipc:///unused", "t", max_inflight_bytes=1 << 20)
    sender = BlockSender(config, KafkaSettings(bootstrap=f"127.0.0.1:{free_port()}"), [1], CompletionSender("ipc:///unused"))
    try:
        assert sender.has_room(10 << 20)  # nothing in flight: even a huge request may go
        assert sender.has_room(1 << 20)
    finally:
        sender.close(timeout=0.1)
