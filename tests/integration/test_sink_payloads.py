"""``hsx sink --payload-store`` on a real broker, with the store a directory and
a real S3 server: inline and by-reference manifests on one topic make one
dataset, and each staged object is deleted once its sample is durable; a sink
killed between its shards and that cleanup leaves nothing behind after its
restart, which settles the stored samples without fetching them; missing, corrupt and forged references are dead letters naming the object; a
sink given no payload store stops at the first by-reference manifest, with
nothing committed; the sweep deletes old staged objects and nothing else."""

from __future__ import annotations

import os
import re
import time
from collections import Counter
from pathlib import Path

import pytest
import torch

from hsx.dataset.reader import open_dataset
from hsx.dataset.storage import Storage, open_storage
from hsx.local.commands import sink_command
from hsx.local.spawn import HsxService
from hsx.local.topics import fresh_topics
from hsx.runtime.settings import KafkaSettings
from hsx.schemas import ErrorClass, HiddenStatesReady, Manifest
from hsx.sink.assembler import Record
from tests.drain import drain
from tests.integration.test_sink_dedupe import run_sink
from tests.reliability.harness import committed, dead_letters, index_counts, publish, wait_until
from tests.unit.test_assembler import records

pytestmark = [pytest.mark.integration]


def staged(store: Storage, request_id: str, key: str | None = None,
           damage: str | None = None) -> tuple[Record, torch.Tensor]:
    """A request's blocks staged as the extractor stages them, and its by-reference
    manifest (``key``: a forged one instead; ``damage``: ``flip`` a byte of the
    object, or ``cut`` its end off)."""
    recs, hidden = records(request_id, tokens=11, per_block=4)
    manifest = Manifest.model_validate_json(recs[-1].value).by_reference()
    assert manifest.payload is not None
    data = bytearray(b"".join(r.value for r in recs[:-1]))
    if damage == "flip":
        data[-3] ^= 0xFF
    elif damage == "cut":
        del data[-100:]
    with store.open_atomic(manifest.payload.key) as out:
        out.write(bytes(data))
    if key is not None:
        manifest = manifest.model_copy(update={"payload": manifest.payload.model_copy(update={"key": key})})
    return Record(0, recs[-1].key, manifest.model_dump_json(exclude_none=True).encode(), recs[-1].headers), hidden


def _staged_keys(store: Storage) -> list[str]:
    return store.stale(".blocks", older_than=-3600)  # every one, however new


@pytest.fixture(params=["directory", "s3"])
def payload_store(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "directory":
        return str(tmp_path / "staging")
    return request.getfixturevalue("s3_dataset_url") + "-staging"


def test_inline_and_by_reference_manifests_make_one_dataset(kafka: KafkaSettings, tmp_path: Path,
                                                            payload_store: str) -> None:
    topics = fresh_topics(kafka, partitions=1)
    store = open_storage(payload_store, create=True)
    inline, inline_hidden = records("inline", tokens=9, per_block=4)
    refs = {rid: staged(store, rid) for rid in ("ref-1", "ref-2")}
    publish(kafka, topics.blocks, inline[:2] + [refs["ref-1"][0]] + inline[2:] + [refs["ref-2"][0]])
    assert len(_staged_keys(store)) == 2

    output = tmp_path / "dataset"
    # On S3 the shards keep the records as they came (byteplane-zstd: verified, never decoded, by
    # reference the staged object itself); on a directory they are decoded to raw.
    codec = "byteplane-zstd" if payload_store.startswith("s3://") else "raw"
    sink = run_sink(kafka, topics, output, tmp_path, "sink", "--payload-store", payload_store, "--dataset-codec", codec,
                    "--spool-after-bytes", "1")  # the shard streamed to its file as samples join
    assert sink.exited() == 0, sink.log_tail()
    dataset = open_dataset(output)
    expected = {"inline": inline_hidden, **{rid: hidden for rid, (_, hidden) in refs.items()}}
    assert sorted(dataset.request_ids()) == sorted(expected)
    for request_id, hidden in expected.items():
        assert torch.equal(dataset[request_id]["hidden_states"], hidden)
    assert committed(kafka, topics.blocks, "hsx-sink", 1)[0] == len(inline) + 2
    assert _staged_keys(store) == []  # deleted once their samples were durable


def test_a_sink_killed_between_shards_and_cleanup_leaves_no_staged_object(kafka: KafkaSettings, tmp_path: Path,
                                                                          payload_store: str) -> None:
    """SIGKILL once every shard is durable and before any commit (the commit,
    which deletes the staged objects first, is an hour away): the restart replays
    every manifest, finds each request stored and drops it as a duplicate without
    fetching (one object is deleted by hand to prove it), announces the samples
    again, commits and deletes every staged object."""
    topics = fresh_topics(kafka, partitions=1)
    store = open_storage(payload_store, create=True)
    refs = {f"ref-{i}": staged(store, f"ref-{i}") for i in range(4)}
    publish(kafka, topics.blocks, [record for record, _ in refs.values()])
    output = tmp_path / "dataset"
    group = f"s-{topics.blocks}"  # of its own: the killed member stays in its group until its session times out
    command = sink_command(kafka.bootstrap, topics, output, "--payload-store", payload_store,
                           "--flush-when-idle", "0.5", "--commit-interval", "3600", group=group)
    with HsxService("killed", command, tmp_path) as sink:
        wait_until(lambda: len(index_counts(output)) == len(refs), 120, "every sample in the dataset",
                   tick=lambda: sink.exited() is None or pytest.fail(sink.log_tail()))
        sink.kill()
    assert committed(kafka, topics.blocks, group, 1)[0] < 0  # nothing committed
    left = _staged_keys(store)
    assert len(left) == len(refs)  # durable samples, objects not yet deleted
    store.delete(left[0])  # as if the cleanup had begun: the restart must not need it

    # Idle for longer than the killed member's session: the group waits for it first.
    restarted = run_sink(kafka, topics, output, tmp_path, "restarted", "--payload-store", payload_store,
                         "--group", group, "--exit-when-idle", "25")
    assert restarted.exited() == 0, restarted.log_tail()
    assert f"{len(refs)} duplicates dropped" in restarted.logs()
    assert index_counts(output) == Counter(list(refs))  # exactly once
    dataset = open_dataset(output)
    for request_id, (_, hidden) in refs.items():
        assert torch.equal(dataset[request_id]["hidden_states"], hidden)
    assert committed(kafka, topics.blocks, group, 1)[0] == len(refs)
    assert _staged_keys(store) == []
    ready = drain(kafka, topics.ready, expected=2 * len(refs), timeout=15)  # the restart announces every sample
    assert {HiddenStatesReady.model_validate_json(r.value()).request_id for r in ready} == set(refs)
    assert drain(kafka, topics.blocks_dlq, expected=1, timeout=3) == []


def test_missing_corrupt_and_forged_references_are_dead_letters(kafka: KafkaSettings, tmp_path: Path) -> None:
    topics = fresh_topics(kafka, partitions=1)
    payload_store = tmp_path / "staging"
    store = open_storage(str(payload_store), create=True)
    secret = tmp_path / "secret.blocks"
    secret.write_bytes(b"not for the sink")
    missing, _ = staged(store, "missing")
    store.delete(Manifest.model_validate_json(missing.value).payload.key)  # type: ignore[union-attr]
    corrupt, _ = staged(store, "corrupt", damage="flip")
    short, _ = staged(store, "short", damage="cut")
    forged = {name: staged(store, name, key)[0] for name, key in [
        ("forged-up", "../secret.blocks"), ("forged-other", f"victim.{'0' * 32}.blocks"), ("forged-abs", str(secret))]}
    publish(kafka, topics.blocks, [missing, corrupt, short, *forged.values()])

    sink = run_sink(kafka, topics, tmp_path / "dataset", tmp_path, "sink", "--payload-store", str(payload_store),
                    "--dataset-codec", "byteplane-zstd")  # blocks verified without being decoded into the sample
    assert sink.exited() == 0, sink.log_tail()
    letters = {r.key().decode(): h for h, r in dead_letters(kafka, topics.blocks_dlq, expected=6)}
    assert letters["missing"].error_class is ErrorClass.PAYLOAD_MISSING
    assert letters["corrupt"].error_class is letters["short"].error_class is ErrorClass.PAYLOAD_CORRUPT
    assert "shorter than its manifest says" in letters["short"].error_message
    for name in ("missing", "corrupt", "short"):  # the message names the object
        assert re.search(rf"{re.escape(str(payload_store))}/{name}\.[0-9a-f]{{32}}\.blocks", letters[name].error_message)
    for name in forged:
        assert letters[name].error_class is ErrorClass.PAYLOAD_FORBIDDEN, letters[name]
    assert secret.read_bytes() == b"not for the sink"
    assert not (tmp_path / "dataset" / "index").exists() or not any((tmp_path / "dataset" / "index").iterdir())
    # Dead-lettered objects are kept for inspection (the sweep removes them).
    assert [key for key in _staged_keys(store) if key.startswith("corrupt.")] != []


def test_a_sink_without_a_payload_store_stops_at_a_reference(kafka: KafkaSettings, tmp_path: Path) -> None:
    topics = fresh_topics(kafka, partitions=1)
    inline, _ = records("inline", tokens=5, per_block=4)
    reference, _ = staged(open_storage(str(tmp_path / "staging"), create=True), "ref")
    publish(kafka, topics.blocks, inline + [reference])
    sink = run_sink(kafka, topics, tmp_path / "dataset", tmp_path, "sink")
    assert sink.exited() == 1, sink.log_tail()
    assert "started without one: start it with the extractor's --payload-store" in sink.logs()
    assert committed(kafka, topics.blocks, "hsx-sink", 1)[0] < len(inline) + 1


def test_the_sweep_deletes_only_old_staged_objects(kafka: KafkaSettings, tmp_path: Path) -> None:
    """An extractor killed between upload and manifest leaves an object no manifest
    names (and, on a file system, a temp file): the sweep deletes what is older than
    --staged-max-age, nothing newer, nothing that is not staged."""
    topics = fresh_topics(kafka, partitions=1)
    staging = tmp_path / "staging"
    store = open_storage(str(staging), create=True)
    staged(store, "orphan-old")
    staged(store, "orphan-new")
    (staging / ".late.0123.blocks.a1b2c3.tmp").write_bytes(b"half an upload")
    (staging / "notes.txt").write_bytes(b"not staged")
    two_hours_ago = time.time() - 7200
    for path in staging.iterdir():
        if not path.name.startswith("orphan-new"):
            os.utime(path, (two_hours_ago, two_hours_ago))
    sink = run_sink(kafka, topics, tmp_path / "dataset", tmp_path, "sink", "--payload-store", str(staging),
                    "--staged-max-age", "3600")
    assert sink.exited() == 0, sink.log_tail()
    left = sorted(p.name for p in staging.iterdir())
    assert len(left) == 2 and left[0] == "notes.txt" and left[1].startswith("orphan-new."), left
