"""``hsx extract --wire-dtype fp8`` end to end, with one engine run shared by the
module: a real vLLM engine (SmolLM2, float32) sends fp8 block records to the
real broker, two real sinks store them (``--dataset-codec fp8``: the codes as
sent; ``raw``: dequantized), and what readers get is within fp8's documented
bound of HF transformers' hidden states. The Kafka bytes are compared with the
bf16 records the connector's codec makes of the same tokens' states, cut into
blocks as the sender cuts them (a bf16 engine run would cost another engine
start for the same statistics)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import orjson
import pytest
import torch
from confluent_kafka import Message, Producer
from safetensors import safe_open

from hsx import models
from hsx.local.topics import fresh_topics
from hsx.reference import HFReference, max_relative_error
from tests.drain import drain
from hsx.codecs.block import encode_block
from hsx.codecs.dataset import read_fp8
from hsx.codecs.fp8 import FLOAT32_SLACK, RELATIVE_BOUND, SUBNORMAL_STEP_BOUND, from_fp8, narrow
from hsx.dataset.reader import open_dataset
from hsx.dataset.sample import Sample
from hsx.runtime.settings import KafkaSettings
from hsx.schemas import Codec, DType, Manifest, RecordKind
from hsx.schemas.dataset_codec import DatasetCodec
from hsx.sink.assembler import Assembler, Record
from tests.engine_helpers import run_extractor
from tests.integration.test_extractor import good_prompts
from tests.integration.test_pipeline import run_sink

pytestmark = [pytest.mark.integration, pytest.mark.engine]

MODEL = "smollm2-135m-instruct"
BLOCK_BYTES = 16384  # several blocks per prompt, so reassembly joins fp8 blocks
ENGINE_TOLERANCE = 1e-4
"""vLLM's float32 hidden states vs HF's, relative to each layer's largest
magnitude: what test_extractor holds the plain wire to."""


@dataclass
class Fp8Run:
    model_dir: Path
    records: list[Message]
    samples: dict[str, Sample]
    """Reassembled from the records as the sink does: the codes the extractor sent."""
    datasets: dict[DatasetCodec, Path] = field(default_factory=dict)


@pytest.fixture(scope="module")
def fp8_run(kafka_bootstrap: str, tmp_path_factory: pytest.TempPathFactory) -> Fp8Run:
    model_dir = models.prepare(names=[MODEL])[MODEL]
    kafka = KafkaSettings(bootstrap=kafka_bootstrap)
    topics = fresh_topics(kafka, partitions=2)
    producer = Producer({"bootstrap.servers": kafka.bootstrap, "enable.idempotence": True})
    for prompt in good_prompts():
        producer.produce(topics.prompts, value=orjson.dumps(prompt), key=prompt["request_id"].encode())
    assert producer.flush(30) == 0
    work = tmp_path_factory.mktemp("wire-fp8")
    log = work / "extract.log"
    result = run_extractor(kafka.bootstrap, topics, f"g-{topics.prompts}", model_dir, log, "--max-model-len", "512",
                           "--block-bytes", str(BLOCK_BYTES), "--wire-dtype", "fp8")
    assert result == 0, log.read_text()[-5000:]
    records = drain(kafka, topics.blocks, expected=1, timeout=30, settle=3.0)
    assemblers: dict[int, Assembler] = {}
    samples = {}
    for record in records:
        assembled = assemblers.setdefault(record.partition(), Assembler()).add(
            Record(record.offset(), record.key(), record.value(), record.headers()))
        if isinstance(assembled, Sample):
            samples[assembled.manifest.request_id] = assembled
        else:
            assert assembled is None, assembled
    run = Fp8Run(model_dir, records, samples)
    for codec in (DatasetCodec.FP8, DatasetCodec.RAW):
        output = work / codec.value
        run_sink(kafka, topics, output, f"s-{codec.value}-{topics.prompts}", work / f"sink-{codec.value}.log",
                 "--dataset-codec", codec.value)
        run.datasets[codec] = output
    assert drain(kafka, topics.blocks_dlq, expected=1, timeout=3) == []
    return run


def test_every_prompt_arrives_as_fp8(fp8_run: Fp8Run) -> None:
    assert sorted(fp8_run.samples) == sorted(p["request_id"] for p in good_prompts())
    for sample in fp8_run.samples.values():
        m = sample.manifest
        assert m.quantization == "fp8" and m.dtype is DType.FLOAT32 and sample.fp8 is not None
    assert any(len(s.manifest.blocks) > 1 for s in fp8_run.samples.values())
    for codec, output in fp8_run.datasets.items():
        dataset = open_dataset(output)
        assert sorted(dataset.request_ids()) == sorted(fp8_run.samples)
        for request_id in dataset.request_ids():
            event = dataset.event(request_id)
            assert event.codec is codec and event.dtype is DType.FLOAT32  # the model's dtype, whatever the wire's


def test_the_fp8_dataset_holds_the_codes_the_extractor_sent(fp8_run: Fp8Run) -> None:
    dataset = open_dataset(fp8_run.datasets[DatasetCodec.FP8])
    raw_dataset = open_dataset(fp8_run.datasets[DatasetCodec.RAW])
    for request_id, sample in fp8_run.samples.items():
        assert sample.fp8 is not None
        event = dataset.event(request_id)
        with safe_open(str(fp8_run.datasets[DatasetCodec.FP8] / event.shard), framework="pt") as shard:
            codes, scales = read_fp8(shard.get_tensor(event.tensors.hidden_states).numpy(), event.shape)
        assert np.array_equal(codes, sample.fp8[0]), request_id  # bit for bit
        assert np.array_equal(scales.view(np.uint32), sample.fp8[1].view(np.uint32)), request_id
        dequantized = torch.from_numpy(narrow(from_fp8(*sample.fp8), DType.FLOAT32).view(np.float32)
                                       .reshape(codes.shape))
        assert torch.equal(dataset[request_id]["hidden_states"], dequantized)
        assert torch.equal(raw_dataset[request_id]["hidden_states"], dequantized)


def test_hidden_states_are_within_the_fp8_bound_of_hf(fp8_run: Fp8Run) -> None:
    """Per element: fp8's bound (:mod:`hsx.codecs.fp8`) around the engine's value,
    which is within ``ENGINE_TOLERANCE`` of HF's."""
    reference = HFReference(fp8_run.model_dir)
    worst: dict[int, float] = {}
    for codec, output in fp8_run.datasets.items():
        dataset = open_dataset(output)
        for request_id in dataset.request_ids():
            got, event = dataset[request_id]["hidden_states"], dataset.event(request_id)
            expected = reference.hidden_states(dataset[request_id]["token_ids"].tolist(), event.layer_ids)
            for j, layer in enumerate(event.layer_ids):
                ref = expected[:, j].numpy()
                slack = ENGINE_TOLERANCE * np.abs(ref).max()
                row_scale = np.abs(ref).max(axis=-1, keepdims=True) / 448 + slack / 448
                bound = np.maximum(RELATIVE_BOUND * (np.abs(ref) + slack), SUBNORMAL_STEP_BOUND * row_scale)
                error = np.abs(got[:, j].numpy() - ref)
                assert (error <= bound * (1 + FLOAT32_SLACK) + slack).all(), (codec, request_id, layer)
                worst[layer] = max(worst.get(layer, 0.0), max_relative_error(got[:, j], expected[:, j]))
    print(f"\nfp8 wire, SmolLM2 float32: max relative error per layer vs HF {worst}")
    assert all(error <= RELATIVE_BOUND + ENGINE_TOLERANCE for error in worst.values()), worst


def test_kafka_bytes_per_token_are_well_under_bf16s(fp8_run: Fp8Run) -> None:
    """fp8 sends a code per element where bf16 sends two bytes; both compress
    (bf16's exponent plane much better than fp8's codes, which a per-row scale
    leaves with little redundancy), so the record bytes come to about 0.6x."""
    manifests = [Manifest.model_validate_json(r.value()) for r in fp8_run.records
                 if dict(r.headers() or []).get("kind") == RecordKind.MANIFEST.value.encode()]
    blocks = [r for r in fp8_run.records if dict(r.headers() or []).get("kind") == RecordKind.BLOCK.value.encode()]
    tokens = sum(m.num_tokens for m in manifests)
    fp8_bytes = sum(len(r.value()) for r in blocks)
    reference = HFReference(fp8_run.model_dir)
    bf16_bytes = bf16_raw = 0
    for m in manifests:
        rows = reference.hidden_states(m.token_ids, m.layer_ids).to(torch.bfloat16)
        per_block = max(1, BLOCK_BYTES // (rows[0].numel() * 2))  # as BlockSender cuts them
        for start in range(0, m.num_tokens, per_block):
            part = rows[start : start + per_block].contiguous()
            bf16_bytes += len(encode_block(part.view(torch.uint8).numpy(), shape=tuple(part.shape),
                                           dtype=DType.BFLOAT16, token_start=start, codec=Codec.BYTEPLANE_ZSTD))
            bf16_raw += part.numel() * 2
    sent_raw = sum(s.fp8[0].nbytes + s.fp8[1].nbytes for s in fp8_run.samples.values())  # type: ignore[union-attr]
    print(f"\nKafka block bytes per token: fp8 {fp8_bytes / tokens:.1f}, bf16 {bf16_bytes / tokens:.1f} "
          f"({fp8_bytes / bf16_bytes:.3f}x); before compression {sent_raw / bf16_raw:.3f}x")
    assert sent_raw <= 0.51 * bf16_raw
    assert fp8_bytes < 0.65 * bf16_bytes
