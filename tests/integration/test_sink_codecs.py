"""``hsx sink --dataset-codec`` on a real broker, read back by real readers
(``open_dataset``, ``follow``): every codec round-trips (lossless bit-exact, fp8
within its documented bound), fp8 block records (``hsx extract --wire-dtype
fp8``) too, and a dataset whose codec changed between two sink runs reads as one."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open

from hsx.dataset.reader import Dataset, follow, open_dataset
from hsx.local.topics import fresh_topics
from hsx.runtime.settings import KafkaSettings, TopicSettings
from hsx.schemas.dataset_codec import DatasetCodec
from hsx.schemas.shard import ShardMetadata
from tests.integration.test_sink_dedupe import run_sink
from tests.reliability.harness import publish
from tests.unit.test_assembler import records
from tests.unit.test_dataset_storage import assert_decoded
from tests.unit.test_fp8_wire import fp8_records

pytestmark = [pytest.mark.integration]


def _publish(kafka: KafkaSettings, topic: str, request_ids: list[str], first_offset: int = 0) -> dict[str, torch.Tensor]:
    """Each request's block records (several blocks) and manifest; its original hidden states."""
    originals, offset = {}, first_offset
    for request_id in request_ids:
        recs, hidden = records(request_id, tokens=11, per_block=4, first_offset=offset)
        publish(kafka, topic, recs)
        originals[request_id], offset = hidden, offset + len(recs)
    return originals


def _stored(kafka: KafkaSettings, topics: TopicSettings, tmp_path: Path, codec: DatasetCodec,
            originals: dict[str, torch.Tensor], *extra: str) -> tuple[Path, Dataset]:
    """One sink run with ``codec`` over the blocks topic until idle: its output
    and dataset, which must hold exactly the requests of ``originals``."""
    output = tmp_path / "dataset"
    sink = run_sink(kafka, topics, output, tmp_path, "sink", "--dataset-codec", codec.value, *extra)
    assert sink.exited() == 0, sink.log_tail()
    dataset = open_dataset(output)
    assert sorted(dataset.request_ids()) == sorted(originals)
    return output, dataset


def _shard_codecs(output: Path) -> set[DatasetCodec]:
    codecs = set()
    for shard in (output / "shards").glob("*.safetensors"):
        with safe_open(str(shard), framework="pt") as handle:
            codecs.add(ShardMetadata.from_safetensors(handle.metadata()).codec)
    return codecs


@pytest.mark.parametrize("codec", list(DatasetCodec))
def test_every_codec_round_trips_through_a_real_sink(kafka: KafkaSettings, tmp_path: Path,
                                                     codec: DatasetCodec) -> None:
    """Shards streamed to their file from the first sample (``--spool-after-bytes 1``;
    the other tests' shards are held until they close)."""
    topics = fresh_topics(kafka, partitions=1)
    originals = _publish(kafka, topics.blocks, ["a", "b", "c"])
    output, dataset = _stored(kafka, topics, tmp_path, codec, originals, "--spool-after-bytes", "1")
    for request_id, hidden in originals.items():
        assert dataset.event(request_id).codec is codec
        assert_decoded(hidden, dataset[request_id]["hidden_states"], codec)
    assert _shard_codecs(output) == {codec}


def test_a_dataset_whose_codec_changed_between_runs_reads_as_one(kafka: KafkaSettings, tmp_path: Path) -> None:
    topics = fresh_topics(kafka, partitions=1)
    output = tmp_path / "dataset"
    originals = _publish(kafka, topics.blocks, ["raw-1", "raw-2"])
    first = run_sink(kafka, topics, output, tmp_path, "first", "--dataset-codec", "byteplane-zstd")
    assert first.exited() == 0, first.log_tail()
    more = _publish(kafka, topics.blocks, ["fp8-1", "fp8-2"], first_offset=100)
    second = run_sink(kafka, topics, output, tmp_path, "second", "--dataset-codec", "fp8-zstd")
    assert second.exited() == 0, second.log_tail()
    originals.update(more)
    assert _shard_codecs(output) == {DatasetCodec.BYTEPLANE_ZSTD, DatasetCodec.FP8_ZSTD}

    dataset = open_dataset(output)
    assert sorted(dataset.request_ids()) == sorted(originals)
    for request_id, hidden in originals.items():
        assert_decoded(hidden, dataset[request_id]["hidden_states"], dataset.event(request_id).codec)
    # Online: the ready events of both runs, each sample decoded as its own shard says.
    followed = {s["request_id"]: s["hidden_states"] for s in follow(kafka.bootstrap, output, topic=topics.ready,
                                                                      idle_timeout=3)}
    assert sorted(followed) == sorted(originals)
    for request_id, hidden in followed.items():
        assert_decoded(originals[request_id], hidden, dataset.event(request_id).codec)


@pytest.mark.parametrize("codec", list(DatasetCodec))
def test_fp8_block_records_are_stored_by_every_codec(kafka: KafkaSettings, tmp_path: Path, codec: DatasetCodec) -> None:
    """fp8 on the wire: ``fp8``/``fp8-zstd`` keep the codes as sent (so the
    reader's values are exactly their dequantization), the others store them
    dequantized to the manifest's bfloat16; a corrupt fp8 block goes to the DLQ."""
    from tests.drain import drain
    from hsx.codecs.block import decode_block, read_header
    from hsx.codecs.fp8 import from_fp8
    from hsx.codecs.fp8_blocks import encode_fp8_block, fp8_rows
    from hsx.schemas import DlqHeaders, Manifest

    topics = fresh_topics(kafka, partitions=1)
    originals, sent, offset = {}, {}, 0
    for request_id in ("f-1", "f-2"):
        recs, hidden = fp8_records(request_id, tokens=11, per_block=4, first_offset=offset)
        publish(kafka, topics.blocks, recs)
        originals[request_id], offset = hidden, offset + len(recs)
        parts = [fp8_rows(*decode_block(r.value)) for r in recs[:-1]]
        sent[request_id] = torch.from_numpy(from_fp8(torch.cat([torch.from_numpy(p[0].copy()) for p in parts]).numpy(),
                                                     torch.cat([torch.from_numpy(p[1].copy()) for p in parts]).numpy()))
    # A block whose CRC and manifest entry match a NaN code: only an fp8 check catches it.
    bad, _ = fp8_records("f-bad", tokens=4, per_block=4, first_offset=offset)
    header, raw = decode_block(bad[0].value)
    codes, scales = (np.array(a) for a in fp8_rows(header, raw))
    codes[2, 1, 3] = 0x7F
    bad[0].value = encode_fp8_block(codes, scales, shape=header.shape, dtype=header.dtype, token_start=0)
    manifest = Manifest.model_validate_json(bad[1].value)
    ref = manifest.blocks[0].model_copy(update={"checksum": read_header(bad[0].value)[0].checksum})
    bad[1].value = manifest.model_copy(update={"blocks": [ref]}).model_dump_json().encode()
    publish(kafka, topics.blocks, bad)
    _, dataset = _stored(kafka, topics, tmp_path, codec, originals)
    for request_id, hidden in originals.items():
        event = dataset.event(request_id)
        assert event.codec is codec and event.dtype.value == "bfloat16" and event.shape == tuple(hidden.shape)
        decoded = dataset[request_id]["hidden_states"]
        assert torch.equal(decoded, sent[request_id].to(torch.bfloat16))  # the codes as sent, dequantized once
        assert_decoded(hidden, decoded, DatasetCodec.FP8)
    (letter,) = drain(kafka, topics.blocks_dlq, expected=1, timeout=30)
    headers = DlqHeaders.from_kafka(letter.headers())
    assert headers.error_class == "corrupt_block", headers
    assert headers.error_message.startswith("block 0: malformed fp8 row at token 2, layer 1"), headers
