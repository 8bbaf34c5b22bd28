"""The connector's sending half with ``wire_dtype: fp8``, without vLLM but with
the real broker: the CPU gather quantizes, the records carry exactly
:func:`hsx.codecs.fp8.to_fp8`'s codes and scales, the manifest says fp8 and keeps
the model's dtype, and rows fp8 cannot hold are reported as a failure."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import zmq

from hsx.extractor.completion import CompletionSender
from hsx.extractor.connector.gather import gather_cpu
from hsx.extractor.connector.sender import BlockSender
from hsx.runtime.kafka import ensure_topics
from tests.drain import drain
from hsx.codecs.fp8 import to_fp8
from hsx.dataset.sample import Sample
from hsx.runtime.settings import KafkaSettings, TopicSettings
from hsx.runtime.tensors import WIRE_DTYPES
from hsx.schemas import Codec
from hsx.sink.assembler import Assembler, Record
from tests.integration.test_block_sender import BLOCK_SIZE, HIDDEN, LAYERS, _config, _job, _receive, _wait_finished

pytestmark = pytest.mark.integration


@pytest.fixture
def completions(tmp_path: Path):  # type: ignore[no-untyped-def]
    """The extractor's end of the completion channel (as in test_block_sender)."""
    socket = zmq.Context.instance().socket(zmq.PULL)
    address = f"ipc://{tmp_path / 'c.sock'}"
    socket.bind(address)
    yield address, socket
    socket.close(linger=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sends_fp8_codes_and_scales_bit_exact(dtype: torch.dtype, kafka: KafkaSettings, topic_settings: TopicSettings,
                                              completions) -> None:  # type: ignore[no-untyped-def]
    address, socket = completions
    ensure_topics(kafka, topic_settings, [topic_settings.blocks])
    cache = (torch.randn(20, LAYERS, BLOCK_SIZE, HIDDEN) * 4).to(dtype)
    cache[6, :, 3] = 0  # a token whose rows are all zero
    config = _config(address, topic_settings.blocks, block_bytes=4096, codec=Codec.BYTEPLANE_ZSTD, wire_dtype="fp8")
    sender = BlockSender(config, kafka, [1, 2, 4], CompletionSender(address))
    try:
        jobs = {name: _job(name, tokens, cache) for name, tokens in (("one", 1), ("many", 70))}
        for job, _ in jobs.values():
            sender.submit(job, gather_cpu(cache, job.block_ids, len(job.token_ids), BLOCK_SIZE, fp8=True))
        reports = {r.request_id: r for r in (_receive(socket) for _ in jobs)}
        assert _wait_finished(sender, {j.engine_request_id for j, _ in jobs.values()})
    finally:
        sender.close()
    assert all(r.ok for r in reports.values()), reports
    assembler, samples = Assembler(), {}
    for record in drain(kafka, topic_settings.blocks, expected=1, settle=2.0):
        result = assembler.add(Record(record.offset(), record.key(), record.value(), record.headers()))
        if result is not None:
            assert isinstance(result, Sample), result
            samples[result.manifest.request_id] = result
    for name, (job, expected) in jobs.items():
        sample = samples[name]
        assert sample.manifest.quantization == "fp8" and sample.manifest.dtype is WIRE_DTYPES[dtype]
        codes, scales = to_fp8(expected.float().numpy())
        assert sample.fp8 is not None and np.array_equal(sample.fp8[0], codes)
        assert np.array_equal(sample.fp8[1].view(np.uint32), scales.view(np.uint32))
        sent_row = LAYERS * HIDDEN + 4 * LAYERS  # blocks are cut by the bytes they carry
        assert len(sample.manifest.blocks) == -(-len(job.token_ids) // (4096 // sent_row))
        assert reports[name].raw_bytes == expected.numel() * expected.element_size()  # in the model's dtype
        assert reports[name].compressed_bytes < expected.numel() * 1.05 + 500 * len(sample.manifest.blocks)


@pytest.mark.parametrize("by_reference", [False, True])
def test_rows_fp8_cannot_hold_are_reported(by_reference: bool, kafka: KafkaSettings, topic_settings: TopicSettings,
                                           completions, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """Inline and by reference (where the staging thread encodes): a failure to
    retry, and by reference no staged object is left."""
    address, socket = completions
    ensure_topics(kafka, topic_settings, [topic_settings.blocks])
    cache = torch.randn(20, LAYERS, BLOCK_SIZE, HIDDEN)
    job, _ = _job("inf", 5, cache)
    cache[job.block_ids[0], 1, 2, 7] = float("inf")
    staging = tmp_path / "staging"
    config = _config(address, topic_settings.blocks, wire_dtype="fp8", payload_store=str(staging) if by_reference else None)
    sender = BlockSender(config, kafka, [1, 2, 4], CompletionSender(address))
    try:
        sender.submit(job, gather_cpu(cache, job.block_ids, 5, BLOCK_SIZE, fp8=True))
        report = _receive(socket)
        assert _wait_finished(sender, {job.engine_request_id}) == {job.engine_request_id}
    finally:
        sender.close(timeout=1)
    assert not report.ok and not report.refused, report
    assert "encoding block 0 failed" in (report.error or "") and "fp8 cannot hold non-finite hidden states" in \
        (report.error or ""), report
    assert not by_reference or [p for p in staging.rglob("*") if p.is_file()] == []
