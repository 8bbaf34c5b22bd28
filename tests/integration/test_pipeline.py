"""Producer → broker → extractor → sink → dataset, the hidden states by
reference through a staging directory (``--payload-store``, ``hsx run``'s
default transport), then a replay: every prompt exactly once in the index and
among ready events, hidden states equal to HF transformers, no staged object
left, and a replayed sink (which needs none: every request is stored) leaves the
dataset byte-identical. A second sink writes the same manifests to S3, reading a
copy of the staged objects: the same samples, bit for bit, read back, followed,
inspected and exported from there. The inline transport runs end to end in
``tests/reliability/test_crash_anywhere.py`` and beside this one in
``tests/integration/test_sink_payloads.py``."""

from __future__ import annotations

import hashlib
import shutil
import time
from collections import Counter
from pathlib import Path

import orjson
import pytest
import torch
from safetensors import safe_open

from hsx import models
from hsx.cli import main
from hsx.dataset.reader import follow, open_dataset
from hsx.local.commands import produce_command, sink_command
from hsx.local.spawn import HsxService
from hsx.local.topics import fresh_topics
from hsx.reference import HFReference, max_relative_error
from hsx.runtime.settings import KafkaSettings, TopicSettings
from hsx.schemas import HiddenStatesReady
from tests.engine_helpers import run_extractor
from tests.reliability.harness import index_counts
from tests.integration.test_extractor import good_prompts
from tests.drain import drain

pytestmark = [pytest.mark.integration, pytest.mark.engine]


def pipeline_sink(kafka: KafkaSettings, topics: TopicSettings, output: str | Path, group: str, log: Path,
                  *extra: str) -> HsxService:
    """``hsx sink`` until idle, small shards, logging to ``log``."""
    command = sink_command(kafka.bootstrap, topics, output, "--exit-when-idle", "6", "--max-shard-samples", "5", *extra,
                           group=group)
    return HsxService(log.stem, command, log.parent)


def run_sink(kafka: KafkaSettings, topics: TopicSettings, output: str | Path, group: str, log: Path, *extra: str) -> None:
    with pipeline_sink(kafka, topics, output, group, log, *extra) as sink:
        returncode = sink.wait(300)
    assert returncode == 0, log.read_text()[-3000:]


def _run_sink_scraped(sink: HsxService) -> tuple[bool, float]:
    """Run the sink with its operations endpoint and probe it until it exits."""
    ready_seen, samples = False, 0.0
    with sink:
        while sink.exited() is None:
            ready_seen |= sink.ready()
            samples = max(samples, sink.metric("hsx_sink_samples_total"))  # NaN (ignored) until it serves
            time.sleep(0.2)
    assert sink.exited() == 0, sink.log_tail()
    return ready_seen, samples


def digest(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def test_pipeline_end_to_end_and_replay(kafka: KafkaSettings, tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                        s3_dataset_url: str) -> None:
    model = models.prepare(names=["tiny-llama"])["tiny-llama"]
    topics = fresh_topics(kafka, partitions=3)
    prompts = good_prompts()
    source = tmp_path / "prompts.jsonl"
    source.write_bytes(b"".join(orjson.dumps(p) + b"\n" for p in prompts))
    with HsxService("produce", produce_command(kafka.bootstrap, topics, source), tmp_path, health=False) as produce:
        assert produce.wait(120) == 0

    staging = tmp_path / "staging"
    assert run_extractor(kafka.bootstrap, topics, f"x-{topics.prompts}", model, tmp_path / "extract.log",
                         "--max-model-len", "512", "--layers", "1,4", "--payload-store", str(staging)) == 0
    staged = sorted(p.name for p in staging.iterdir())
    assert len(staged) == len(prompts), staged  # one staged object per request (one attempt each)
    shutil.copytree(staging, tmp_path / "staging-copy")  # for the S3 copy: each dataset takes its own
    output = tmp_path / "dataset"
    sink = pipeline_sink(kafka, topics, output, f"s-{topics.prompts}", tmp_path / "sink.log",
                         "--payload-store", str(staging))
    ready_seen, samples_seen = _run_sink_scraped(sink)
    assert ready_seen and samples_seen > 0, "the sink's /readyz or hsx_sink_samples_total never moved"
    assert list(staging.iterdir()) == []  # every staged object deleted once its sample was durable

    dataset = open_dataset(output)
    expected_ids = {p["request_id"] for p in prompts}
    assert sorted(dataset.request_ids()) == sorted(expected_ids)  # exactly once in the index
    ready = [HiddenStatesReady.model_validate_json(r.value()) for r in drain(kafka, topics.ready, expected=len(prompts))]
    assert Counter(e.request_id for e in ready) == Counter(expected_ids)  # exactly once among ready events

    reference = HFReference(model)
    for event in ready:
        with safe_open(str(output / event.shard), framework="pt") as shard:  # the named shard holds the sample
            assert event.tensors.hidden_states in shard.keys()
        sample = dataset[event.request_id]
        expected = reference.hidden_states(sample["token_ids"].tolist(), event.layer_ids)
        assert max_relative_error(sample["hidden_states"], expected) <= 1e-4, event.request_id
        assert sample["metadata"] == (next(p for p in prompts if p["request_id"] == event.request_id).get("metadata") or {})
        chat = "messages" in next(p for p in prompts if p["request_id"] == event.request_id)
        assert (sample["loss_mask"] is not None) == chat

    followed = list(follow(kafka.bootstrap, output, topic=topics.ready, idle_timeout=5))
    assert sorted(s["request_id"] for s in followed) == sorted(expected_ids)
    assert all(torch.equal(s["hidden_states"], dataset[s["request_id"]]["hidden_states"]) for s in followed)

    assert main(["inspect", str(output)]) == 0
    assert f"samples      {len(prompts)}" in capsys.readouterr().out

    exported = tmp_path / "speculators"
    assert main(["export", str(exported), "--dataset", str(output)]) == 0
    _check_speculators_layout(exported, dataset)

    before = digest(output)
    # A new group reads from the start, this time with transactions: every request is a
    # duplicate, settled from its manifest, so the deleted staged objects are not missed.
    run_sink(kafka, topics, output, f"replay-{topics.prompts}", tmp_path / "replay.log", "--exactly-once",
             "--payload-store", str(staging))
    assert digest(output) == before
    assert len(open_dataset(output)) == len(prompts)
    assert f"{len(prompts)} duplicates dropped" in (tmp_path / "replay.log").read_text()
    # Duplicates re-announce their sample under the same event id (a crash may have
    # come between a shard and its events); consumers de-duplicate by event id.
    again = [HiddenStatesReady.model_validate_json(r.value()) for r in drain(kafka, topics.ready, expected=2 * len(prompts))]
    assert Counter(e.event_id for e in again) == Counter({e.event_id: 2 for e in ready})

    _check_s3_copy(kafka, topics, tmp_path, s3_dataset_url, dataset, capsys)


def _check_s3_copy(kafka: KafkaSettings, topics: TopicSettings, tmp_path: Path, url: str, local,  # type: ignore[no-untyped-def]
                   capsys: pytest.CaptureFixture[str]) -> None:
    """The same manifests, sunk by another group into ``url`` from a copy of the
    staged objects (ready events on a topic of their own): every sample once (lost
    0, duplicated 0) and bit-identical to the local dataset's, the copy emptied;
    follow, inspect and export read it from S3."""
    ready_topic = f"{topics.ready}-s3"
    run_sink(kafka, topics, url, f"s3-{topics.prompts}", tmp_path / "s3-sink.log", "--ready-topic", ready_topic,
             "--payload-store", str(tmp_path / "staging-copy"))
    assert index_counts(url) == Counter(local.request_ids())
    assert list((tmp_path / "staging-copy").iterdir()) == []
    remote = open_dataset(url)
    for request_id in local.request_ids():
        want, got = local[request_id], remote[request_id]
        assert torch.equal(got["token_ids"], want["token_ids"]) and got["metadata"] == want["metadata"]
        assert torch.equal(got["hidden_states"].view(torch.uint8), want["hidden_states"].view(torch.uint8)), request_id
        assert (got["loss_mask"] is None and want["loss_mask"] is None) or torch.equal(got["loss_mask"], want["loss_mask"])
    followed = list(follow(kafka.bootstrap, url, topic=ready_topic, idle_timeout=5))
    assert sorted(s["request_id"] for s in followed) == sorted(local.request_ids())
    capsys.readouterr()
    assert main(["inspect", url]) == 0
    assert f"samples      {len(local)}" in capsys.readouterr().out
    exported = tmp_path / "speculators-from-s3"
    assert main(["export", str(exported), "--dataset", url]) == 0
    _check_speculators_layout(exported, remote)


def _check_speculators_layout(exported: Path, dataset) -> None:  # type: ignore[no-untyped-def]
    """Read the export the way speculators' ArrowDataset does (v0.5+)."""
    from datasets import load_from_disk
    from safetensors.torch import load_file

    rows = load_from_disk(str(exported))

    def mask(sample) -> torch.Tensor:  # type: ignore[no-untyped-def]
        return sample["loss_mask"] if sample["loss_mask"] is not None else torch.ones_like(sample["token_ids"])

    # As speculators does, the export drops rows with nothing to learn (a chat with no assistant turn).
    kept = [r for r in dataset.request_ids() if mask(dataset[r]).any()]
    assert 0 < len(kept) < len(dataset) and len(rows) == len(kept)
    for i, request_id in enumerate(kept):
        hs = load_file(str(exported / "hidden_states" / f"hs_{i}.safetensors"))
        assert torch.equal(hs["token_ids"], rows[i]["input_ids"])  # the trainer drops rows where this fails
        sample = dataset[request_id]
        assert torch.equal(hs["hidden_states"], sample["hidden_states"])
        assert torch.equal(rows[i]["loss_mask"].bool(), mask(sample).bool())
        assert int(rows[i]["seq_len"]) == hs["token_ids"].shape[0]
