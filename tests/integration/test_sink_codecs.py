"""``hsx sink --dataset-codec`` on a real broker, read back by real readers
(``open_dataset``, ``follow``): every codec round-trips (lossless bit-exact, fp8
within its documented bound), and a dataset whose codec changed between two sink
runs reads as one."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from hsx.dev.topics import fresh_topics
from runtime.settings import KafkaSettings
from schemas.dataset_codec import DatasetCodec
from schemas.shard import ShardMetadata
from sink.reader import follow, open_dataset
from tests.integration.test_sink_dedupe import run_sink
from tests.reliability.harness import publish
from tests.unit.test_assembler import records
from tests.unit.test_dataset_storage import assert_decoded

pytestmark = [pytest.mark.integration]


def _publish(kafka: KafkaSettings, topic: str, request_ids: list[str], first_offset: int = 0) -> dict[str, torch.Tensor]:
    """Each request's block records (several blocks) and manifest; its original hidden states."""
    originals, offset = {}, first_offset
    for request_id in request_ids:
        recs, hidden = records(request_id, tokens=11, per_block=4, first_offset=offset)
        publish(kafka, topic, recs)
        originals[request_id], offset = hidden, offset + len(recs)
    return originals


def _shard_codecs(output: Path) -> set[DatasetCodec]:
    codecs = set()
    for shard in (output / "shards").glob("*.safetensors"):
        with safe_open(str(shard), framework="pt") as handle:
            codecs.add(ShardMetadata.from_safetensors(handle.metadata()).codec)
    return codecs


@pytest.mark.parametrize("codec", list(DatasetCodec))
def test_every_codec_round_trips_through_a_real_sink(kafka: KafkaSettings, tmp_path: Path,
                                                     codec: DatasetCodec) -> None:
    topics = fresh_topics(kafka, partitions=1)
    originals = _publish(kafka, topics.blocks, ["a", "b", "c"])
    output = tmp_path / "dataset"
    sink = run_sink(kafka, topics, output, tmp_path, "sink", "--dataset-codec", codec.value)
    assert sink.exited() == 0, sink.log_tail()
    dataset = open_dataset(output)
    assert sorted(dataset.request_ids()) == sorted(originals)
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
