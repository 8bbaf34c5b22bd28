"""The sink's dedupe index: what a partition already holds is known from compact
keys, also far back, also in datasets written before key files existed; a shard
a kill left without its index is removed; damaged key files are rebuilt, a
damaged index is named in one line; the blocks topic's partition count is
recorded and a changed one refused."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from hsx.dataset.reader import open_dataset
from hsx.dataset.index import CorruptIndex, MissingShard
from hsx.dataset.shards import INDEX, KEYS, SHARDS, OpenShard, partition_prefix, shard_stem, write_shard
from hsx.dataset.storage import LocalStorage
from hsx.local.datasets import tiny_sample, write_tiny_dataset
from hsx.runtime.errors import HsxError
from hsx.runtime.settings import KafkaSettings, TopicSettings
from hsx.schemas.keys import KEY_RECORD, KEYS_MAGIC, decode_keys, encode_keys, request_key, token_key
from hsx.schemas.shard import TopicRecord
from hsx.sink.keys import ROLLUP_AFTER, KeyIndex, rollup_path
from hsx.sink.options import SinkOptions
from hsx.sink.partition import DatasetDamaged, PartitionState
from hsx.sink.partition_count import PartitionCountChanged, check_partition_count, record_path
from hsx.sink.service import Sink

TOPIC = "hidden_states.blocks"


def load(storage: LocalStorage, partition: int = 0) -> PartitionState:
    return PartitionState.load(storage, TOPIC, partition, incomplete_timeout=600)


def files(root: Path, folder: str) -> list[str]:
    return sorted(p.name for p in (root / folder).iterdir()) if (root / folder).is_dir() else []


def test_a_retry_of_a_request_stored_100k_samples_earlier_is_recognised(tmp_path: Path) -> None:
    storage = LocalStorage(tmp_path)
    ids = [f"req-{i}" for i in range(100_000)]
    next_offset = write_tiny_dataset(storage, TOPIC, 0, ids, per_shard=10_000)
    write_tiny_dataset(storage, TOPIC, 0, ["latest"], first_offset=next_offset)
    state = load(storage)
    assert len(state.keys) == 100_001
    assert state.keys.nbytes <= 24 * len(state.keys)  # the whole dedupe state: 24 bytes a sample

    retry = state.stored_copy(storage, "req-0", [0])
    assert retry is not None and retry.same_tokens
    assert retry.event is not None and retry.event.request_id == "req-0"
    assert retry.event.shard == f"{SHARDS}/{shard_stem(TOPIC, 0, 0)}.safetensors"  # re-announced as stored
    conflict = state.stored_copy(storage, "req-54321", [7])  # the same id for another prompt
    assert conflict is not None and not conflict.same_tokens
    assert state.stored_copy(storage, "req-100000", [0]) is None
    assert state.stored_copy(storage, "latest", [0]) is not None


def test_samples_written_after_the_load_are_known_too(tmp_path: Path) -> None:
    storage = LocalStorage(tmp_path)
    state = load(storage)
    state.shard.add(tiny_sample("open", 5))
    open_copy = state.stored_copy(storage, "open", [0])
    assert open_copy == type(open_copy)(None, True)  # in the open shard: its event comes with the shard
    state.close_shard()
    write_shard(storage, "tiny", state.closed[0])
    state.written()
    stored = state.stored_copy(storage, "open", [0])
    assert stored is not None and stored.event is not None and stored.same_tokens
    assert not state.stored_copy(storage, "open", [1]).same_tokens  # type: ignore[union-attr]


def test_an_orphan_shard_left_by_a_kill_is_removed(tmp_path: Path) -> None:
    storage = LocalStorage(tmp_path)
    write_tiny_dataset(storage, TOPIC, 0, ["a", "b"], per_shard=1)  # shards at offsets 0 and 1
    write_tiny_dataset(storage, TOPIC, 1, ["other-partition"], first_offset=9)
    # A kill after the shard and its keys were written, before its index:
    orphan = shard_stem(TOPIC, 0, 2)
    write_tiny_dataset(storage, TOPIC, 0, ["c"], first_offset=2)
    (tmp_path / INDEX / f"{orphan}.json").unlink()
    # ... and one after the shard alone (a shard that was being replaced by the replay).
    lone = shard_stem(TOPIC, 0, 3)
    write_tiny_dataset(storage, TOPIC, 0, ["d"], first_offset=3)
    (tmp_path / INDEX / f"{lone}.json").unlink()
    (tmp_path / KEYS / f"{lone}.keys").unlink()

    state = load(storage)
    assert f"{orphan}.safetensors" not in files(tmp_path, SHARDS) and f"{lone}.safetensors" not in files(tmp_path, SHARDS)
    assert f"{orphan}.keys" not in files(tmp_path, KEYS)
    assert len(files(tmp_path, SHARDS)) == 3  # partition 0's two indexed shards and partition 1's
    assert state.stored_copy(storage, "c", [0]) is None  # its records are replayed and stored again
    assert state.stored_copy(storage, "b", [0]) is not None


def test_only_the_files_of_exactly_this_partition_count(tmp_path: Path) -> None:
    """``a-0001-`` is also the start of topic ``a-0001-x``'s names."""
    storage = LocalStorage(tmp_path)
    write_tiny_dataset(storage, "a-0001-x", 0, ["theirs"])
    write_tiny_dataset(storage, "a", 1, ["ours"], first_offset=0)
    state = PartitionState.load(storage, "a", 1, 600)
    assert len(state.keys) == 1 and state.stored_copy(storage, "theirs", [0]) is None
    assert len(files(tmp_path, SHARDS)) == 2  # nothing of the other topic was taken for an orphan


def test_a_dataset_from_before_key_files_gets_them_once(tmp_path: Path) -> None:
    storage = LocalStorage(tmp_path)
    write_tiny_dataset(storage, TOPIC, 0, [f"old-{i}" for i in range(30)], per_shard=10)
    for path in (tmp_path / KEYS).iterdir():
        path.unlink()
    state = load(storage)
    assert len(state.keys) == 30 and state.stored_copy(storage, "old-29", [0]) is not None
    assert len(files(tmp_path, KEYS)) == 3
    assert len(load(storage).keys) == 30


def test_a_damaged_key_file_is_rebuilt_from_its_index(tmp_path: Path) -> None:
    storage = LocalStorage(tmp_path)
    write_tiny_dataset(storage, TOPIC, 0, ["x", "y"])
    key_file = tmp_path / KEYS / f"{shard_stem(TOPIC, 0, 0)}.keys"
    key_file.write_bytes(key_file.read_bytes()[:-3])
    state = load(storage)
    assert state.stored_copy(storage, "y", [0]) is not None
    assert len(decode_keys(key_file.read_bytes(), key_file.name)) == 2


def test_many_small_shards_are_rolled_up(tmp_path: Path) -> None:
    storage = LocalStorage(tmp_path)
    ids = [f"s-{i}" for i in range(2 * ROLLUP_AFTER)]
    write_tiny_dataset(storage, TOPIC, 0, ids, per_shard=2)
    assert len(load(storage).keys) == len(ids)
    rollup = tmp_path / rollup_path(partition_prefix(TOPIC, 0))
    assert len(decode_keys(rollup.read_bytes(), rollup.name)) == len(ids)
    write_tiny_dataset(storage, TOPIC, 0, ["after"], first_offset=len(ids))
    state = load(storage)  # the roll-up plus the one shard indexed since
    assert len(state.keys) == len(ids) + 1
    assert all(state.stored_copy(storage, i, [0]) is not None for i in ("s-0", "s-63", "after"))


def test_a_key_collision_is_resolved_by_the_index(tmp_path: Path) -> None:
    """Two ids with one 64-bit key: the index says which one is stored."""
    storage = LocalStorage(tmp_path)
    write_tiny_dataset(storage, TOPIC, 0, ["stored"])
    state = load(storage)
    state.keys.add(np.array([(request_key("unknown"), token_key([0]), 0)], KEY_RECORD))
    assert state.stored_copy(storage, "unknown", [0]) is None


def test_keys_naming_a_missing_index_are_an_error(tmp_path: Path) -> None:
    storage = LocalStorage(tmp_path)
    write_tiny_dataset(storage, TOPIC, 0, ["gone"])
    state = load(storage)
    (tmp_path / INDEX / f"{shard_stem(TOPIC, 0, 0)}.json").unlink()
    with pytest.raises(DatasetDamaged, match="which is missing"):
        state.stored_copy(storage, "gone", [0])


@pytest.mark.parametrize("damage, error, problem", [
    (lambda root, index: index.write_bytes(index.read_bytes()[:-9]), CorruptIndex, "is not a shard index"),
    (lambda root, index: index.write_bytes(index.read_bytes().replace(b'"dtype":"float32"', b'"dtype":"int8"')),
     CorruptIndex, r"events\.0\.dtype"),
    (lambda root, index: next((root / SHARDS).iterdir()).unlink(), MissingShard, "named by the index of sample a"),
])
def test_a_damaged_index_stops_a_restart_in_one_line(tmp_path: Path, damage: Callable[[Path, Path], object],
                                                     error: type[Exception], problem: str) -> None:
    """A restart that must read an index (no key file: built from the index and
    the shard's token ids) names what is damaged, as an HsxError (the sink stops
    in one line), never a traceback of the parser's; the reader does the same."""
    storage = LocalStorage(tmp_path)
    write_tiny_dataset(storage, TOPIC, 0, ["a", "b"])
    for path in (tmp_path / KEYS).iterdir():
        path.unlink()
    damage(tmp_path, tmp_path / INDEX / f"{shard_stem(TOPIC, 0, 0)}.json")
    with pytest.raises(error, match=problem) as refused:
        load(storage)
    assert isinstance(refused.value, HsxError)
    if error is CorruptIndex:
        with pytest.raises(CorruptIndex, match=f"{INDEX}/{shard_stem(TOPIC, 0, 0)}.json is not a shard index"):
            open_dataset(tmp_path)


def test_the_key_index_merges_what_was_added() -> None:
    index = KeyIndex.of(np.array([(5, 1, 0), (3, 2, 0)], KEY_RECORD))
    index.add(np.array([(4, 3, 10), (2**64 - 1, 4, 10)], KEY_RECORD))
    records = index.records()
    assert records["request"].tolist() == [3, 4, 5, 2**64 - 1] and not index.recent
    assert len(index) == 4 and index.tokens.tolist() == [2, 3, 1, 4]


@pytest.mark.parametrize("data, problem", [(b"nope", "is not a key file"), (KEYS_MAGIC + b"x" * 25, "is truncated")])
def test_a_bad_key_file_is_named(data: bytes, problem: str) -> None:
    with pytest.raises(ValueError, match=f"k.keys {problem}"):
        decode_keys(data, "k.keys")


def test_key_records_must_have_the_contract_dtype() -> None:
    with pytest.raises(ValueError, match="dtype"):
        encode_keys(np.zeros(2, "<u8"))
    assert decode_keys(encode_keys(np.zeros(0, KEY_RECORD)), "empty").size == 0


def test_listing_filters_by_name_and_position(tmp_path: Path) -> None:
    storage = LocalStorage(tmp_path)
    for name in ("a-1", "a-2", "a-3", "b-1"):
        storage.write_atomic(f"d/{name}", b"")
    assert storage.list("d", starting="a-") == ["d/a-1", "d/a-2", "d/a-3"]
    assert storage.list("d", starting="a-", after="a-1") == ["d/a-2", "d/a-3"]
    assert storage.list("d", after="a-3") == ["d/b-1"]


def test_an_open_shard_finds_its_samples_by_id() -> None:
    shard = OpenShard(TOPIC, 0)
    shard.add(tiny_sample("q", 1))
    assert shard.by_id["q"].manifest_offset == 1


def test_the_partition_count_is_recorded_then_checked(tmp_path: Path) -> None:
    storage = LocalStorage(tmp_path)
    assert check_partition_count(storage, TOPIC, 4, "out/ds") == 4
    assert TopicRecord.model_validate_json((tmp_path / record_path(TOPIC)).read_bytes()).partitions == 4
    assert check_partition_count(storage, TOPIC, 4, "out/ds") == 4
    with pytest.raises(PartitionCountChanged) as refused:
        check_partition_count(storage, TOPIC, 6, "out/ds")
    message = str(refused.value)
    assert "\n" not in message
    assert f"out/ds was written from {TOPIC} with 4 partitions, but {TOPIC} now has 6" in message
    assert "Write to a new --output" in message and record_path(TOPIC) in message
    (tmp_path / record_path(TOPIC)).write_text("{}")
    with pytest.raises(PartitionCountChanged, match="is not a topic record"):
        check_partition_count(storage, TOPIC, 4, "out/ds")


def test_partitions_added_while_the_sink_runs_stop_it(tmp_path: Path) -> None:
    """A rebalance that hands out a partition beyond the recorded count."""
    sink = Sink(KafkaSettings(bootstrap="localhost:1"), TopicSettings(), SinkOptions(output=tmp_path))
    sink._recorded_partitions = 2
    sink.assigned([(sink.topics.blocks, 0), (sink.topics.blocks, 2)])
    assert sink.member.stopping and isinstance(sink.member.fatal, PartitionCountChanged)
    assert "with 2 partitions, but" in str(sink.member.fatal) and "now has at least 3" in str(sink.member.fatal)
    assert sink._partitions == {}  # none of them is read: nothing of them is committed


class _NoKeyWrites(LocalStorage):
    """A disk that is full for key files (derived data) only."""

    def write_atomic(self, relative: str, data: bytes) -> None:
        if relative.startswith(f"{KEYS}/"):
            raise OSError(28, "No space left on device")
        super().write_atomic(relative, data)


def test_key_files_that_cannot_be_written_do_not_stop_the_assignment(tmp_path: Path) -> None:
    write_tiny_dataset(LocalStorage(tmp_path), TOPIC, 0, [f"f-{i}" for i in range(ROLLUP_AFTER)], per_shard=1)
    for path in (tmp_path / KEYS).iterdir():
        path.unlink()
    storage = _NoKeyWrites(tmp_path)
    state = load(storage)  # neither the shards' key files nor the roll-up can be written
    assert len(state.keys) == ROLLUP_AFTER and state.stored_copy(storage, "f-7", [0]) is not None
    assert files(tmp_path, KEYS) == []
