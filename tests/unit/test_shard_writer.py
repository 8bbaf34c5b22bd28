"""The sink's shard writer: shards are written in a thread of their own while the
loop goes on; a partition's shards land one at a time, in order; samples waiting
to be written count against the budget and are found by dedupe; a failed write
is retried after the backoff; refused storage stops the service. Real shards on
a real disk; the disk is held or broken on purpose, and ready events are
recorded instead of published (the Kafka side has tests of its own)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path

from hsx.dataset.shards import SHARDS, OpenShard, shard_stem
from hsx.dataset.storage import LocalStorage, StorageRefused, Writer
from hsx.local.datasets import tiny_sample
from hsx.schemas import HiddenStatesReady
from hsx.sink.partition import PartitionState
from hsx.sink.shard_writer import ShardWriter
from hsx.sink.stats import SinkStats

TOPIC = "hidden_states.blocks"


class HeldDisk(LocalStorage):
    """A disk whose shard writes wait for ``release`` and may fail first."""

    def __init__(self, root: Path, failures: list[BaseException] | None = None) -> None:
        super().__init__(root)
        self.release = threading.Event()
        self.failures = failures or []

    def open_atomic(self, relative: str, cache: bool = True) -> AbstractContextManager[Writer]:
        if relative.startswith(f"{SHARDS}/"):
            assert self.release.wait(30), "the test never released the disk"
            if self.failures:
                raise self.failures.pop(0)
        return super().open_atomic(relative, cache)


class Recorded:
    """Stands in for the ready publisher: records each shard's events and marks
    them delivered; and for the sink, told of each shard in the dataset."""

    def __init__(self) -> None:
        self.events: list[list[str]] = []
        self.written: list[list[str]] = []

    def shard_written(self, _state: PartitionState, shard: OpenShard) -> None:
        self.written.append([s.manifest.request_id for s in shard.samples])

    def publish(self, events: list[HiddenStatesReady], done: Callable[[], None]) -> None:
        self.events.append([e.request_id for e in events])
        done()


@contextmanager
def writer(storage: LocalStorage) -> Iterator[tuple[ShardWriter, PartitionState, Recorded, list[int],
                                                    list[BaseException]]]:
    ready, done, failed = Recorded(), [], []
    shards = ShardWriter(storage, "tiny", ready, SinkStats(), failed.append,  # type: ignore[arg-type]
                         lambda _state, offsets: done.extend(offsets), ready.shard_written)
    try:
        yield shards, PartitionState.load(storage, TOPIC, 0, 600), ready, done, failed
    finally:
        shards.shutdown()


def _until(condition: Callable[[], bool], shards: ShardWriter, state: PartitionState) -> None:
    deadline = time.monotonic() + 30
    while not condition():
        assert time.monotonic() < deadline, "the writer never finished"
        shards.reap([state])
        time.sleep(0.01)


def test_the_loop_goes_on_while_a_shard_is_written_and_shards_land_in_order(tmp_path: Path) -> None:
    storage = HeldDisk(tmp_path)
    with writer(storage) as (shards, state, ready, done, _):
        state.shard.add(tiny_sample("a", 0))
        shards.close(state)  # returns while the disk holds the write
        state.shard.add(tiny_sample("b", 1))
        state.shard.add(tiny_sample("c", 2))
        shards.close(state)
        shards.reap([state])
        assert [len(s.samples) for s in state.closed] == [1, 2] and ready.events == ready.written == [] and done == []
        assert state.buffered_bytes == sum(len(s.hidden_states) for c in state.closed for s in c.samples)
        waiting = state.stored_copy(storage, "c", [0])  # a retry of a sample not yet written is a duplicate
        assert waiting is not None and waiting.event is None and waiting.same_tokens

        storage.release.set()
        _until(lambda: not state.closed, shards, state)
        assert ready.events == ready.written == [["a"], ["b", "c"]] and done == [0, 1, 2]
        assert sorted(p.name for p in (tmp_path / SHARDS).iterdir()) == [
            f"{shard_stem(TOPIC, 0, offset)}.safetensors" for offset in (0, 1)]
        stored = state.stored_copy(storage, "c", [0])
        assert stored is not None and stored.event is not None and stored.event.request_id == "c"
        assert state.buffered_bytes == 0


def test_a_failed_write_is_retried_after_the_backoff(tmp_path: Path) -> None:
    storage = HeldDisk(tmp_path, failures=[OSError(28, "No space left on device")])
    storage.release.set()
    with writer(storage) as (shards, state, ready, done, failed):
        state.shard.add(tiny_sample("a", 0))
        shards.close(state)
        assert not shards.wait(state)  # the first attempt failed: nothing announced, nothing done
        assert ready.events == ready.written == [] and done == [] and len(state.closed) == 1
        shards.reap([state])
        assert state.writing is None, "retried before the backoff ran out"
        _until(lambda: not state.closed, shards, state)
        assert ready.events == [["a"]] and done == [0] and failed == []


def test_settle_writes_every_shard_now(tmp_path: Path) -> None:
    """Revoke and the final flush: the open shard too, and past a running backoff."""
    storage = HeldDisk(tmp_path, failures=[OSError(5, "Input/output error")])
    storage.release.set()
    with writer(storage) as (shards, state, ready, done, _):
        state.shard.add(tiny_sample("a", 0))
        shards.close(state)
        assert not shards.wait(state)  # backoff running
        state.shard.add(tiny_sample("b", 1))
        shards.settle(state)
        assert ready.events == [["a"], ["b"]] and done == [0, 1] and not state.closed and not state.shard.samples


def test_refused_storage_stops_the_service_and_is_not_retried(tmp_path: Path) -> None:
    refused = StorageRefused("access denied: check the keys")
    storage = HeldDisk(tmp_path, failures=[refused])
    storage.release.set()
    with writer(storage) as (shards, state, ready, done, failed):
        state.shard.add(tiny_sample("a", 0))
        shards.close(state)
        shards.wait(state)
        state.write_backoff.retry_at = 0.0
        shards.reap([state])
        assert failed == [refused] and state.writing is None and ready.events == [] and done == []
        shards.settle(state)  # the final flush after a failure writes nothing either
        assert state.writing is None and len(state.closed) == 1


def test_lost_partitions_wait_only_for_the_write_under_way(tmp_path: Path) -> None:
    storage = HeldDisk(tmp_path)
    with writer(storage) as (shards, state, ready, _, _):
        state.shard.add(tiny_sample("a", 0))
        shards.close(state)
        state.shard.add(tiny_sample("b", 1))
        shards.close(state)
        threading.Timer(0.2, storage.release.set).start()
        assert shards.wait(state)
        assert ready.events == [["a"]] and [s.samples[0].manifest.request_id for s in state.closed] == ["b"]
