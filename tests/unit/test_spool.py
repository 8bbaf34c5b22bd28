"""Shards streamed to their file as samples join (hsx.dataset.spool): the same
tensors as a shard held until it closes, in every codec; samples leave memory
once their bytes are in the file; a spool that fails loses nothing."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from hsx.dataset import spool as spool_module
from hsx.dataset.encoding import encode
from hsx.dataset.reader import open_dataset
from hsx.dataset.sample import FileRange, Sample
from hsx.dataset.shards import SHARDS, OpenShard, Spooling, write_shard
from hsx.dataset.storage import LocalStorage
from hsx.dataset.storage import direct_file
from hsx.schemas.dataset_codec import DatasetCodec
from hsx.sink.assembler import Assembler
from hsx.sink.partition import PartitionState
from tests.unit.test_assembler import feed, records
from tests.unit.test_dataset_storage import assert_decoded

TOPIC = "hidden_states.blocks"


@pytest.fixture
def small_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Write buffers of two pages, so a few samples fill one and leave memory."""
    monkeypatch.setattr(direct_file, "CHUNK", 2 * direct_file.ALIGN)
    monkeypatch.setattr(direct_file, "_free", [])


def _samples(codec: DatasetCodec, count: int, tokens: int = 40) -> list[tuple[Sample, torch.Tensor]]:
    out = []
    for k in range(count):
        recs, hidden = records(f"req-{k}", tokens=tokens, first_offset=100 * k)
        (sample,) = feed(Assembler(), recs)
        assert isinstance(sample, Sample)
        if k % 2:  # every other one with a loss mask: the masks go after the streamed bytes
            sample.manifest = sample.manifest.model_copy(update={"loss_mask_spans": [(1, 4), (6, tokens)]})
        out.append((encode(sample, codec), hidden))
    return out


def _write(root: Path, samples: list[Sample], spooling: Spooling | None) -> OpenShard:
    shard = OpenShard(TOPIC, 0, spooling)
    for sample in samples:
        assert shard.accepts(sample)
        shard.add(sample)
    write_shard(LocalStorage(root), root.name, shard)
    shard.discard()
    return shard


def _tensors(root: Path) -> dict[str, torch.Tensor]:
    (path,) = (root / SHARDS).iterdir()
    with safe_open(str(path), framework="pt") as handle:
        return {name: handle.get_tensor(name) for name in handle.keys()}


def _same_shard(held: Path, streamed: Path) -> None:
    expected, got = _tensors(held), _tensors(streamed)
    assert expected.keys() == got.keys()
    for name, tensor in expected.items():
        assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name
    assert [p.name for p in (streamed / SHARDS).iterdir()] == [p.name for p in (held / SHARDS).iterdir()]


@pytest.mark.parametrize("codec", list(DatasetCodec))
def test_a_streamed_shard_holds_what_a_held_one_holds(tmp_path: Path, codec: DatasetCodec,
                                                      small_chunks: None) -> None:
    pairs = _samples(codec, 12)
    _write(tmp_path / "held", [s for s, _ in _samples_copy(pairs)], None)
    shard = _write(tmp_path / "streamed", [s for s, _ in pairs], Spooling(tmp_path / "streamed" / SHARDS, 1))
    assert shard.spool is not None and shard.spool.landed and not shard.spool.broken
    _same_shard(tmp_path / "held", tmp_path / "streamed")
    dataset = open_dataset(tmp_path / "streamed")
    for sample, hidden in pairs:
        assert_decoded(hidden, dataset[sample.manifest.request_id]["hidden_states"], codec)
    # The streamed samples left memory as their bytes reached the file.
    assert sum(isinstance(s.hidden_states, FileRange) for s, _ in pairs) >= 4


def _left_in_file(staged: Path, samples: list[Sample]) -> None:
    """Move the samples' stored bytes into ``staged``, as a sample by reference
    from a staging directory stays in its staged file."""
    with staged.open("wb") as out:
        for sample in samples:
            data = bytes(sample.hidden_states)
            sample.hidden_states = FileRange(staged, out.tell(), len(data))
            out.write(data)


def _samples_copy(pairs: list[tuple[Sample, torch.Tensor]]) -> list[tuple[Sample, torch.Tensor]]:
    """The same samples as new objects (streaming replaces a sample's bytes by their place in the file)."""
    return [(Sample(s.manifest, s.hidden_states, s.offsets, s.records, s.codec, s.checksum, s.fp8), h)
            for s, h in pairs]


def test_samples_left_in_their_staged_file_stream_from_it(tmp_path: Path, small_chunks: None) -> None:
    """By reference from a directory, a sample's bytes stay in the staged file
    (a :class:`FileRange`) until the shard takes them. Such samples hold no
    memory, so they alone never start a spool; after one that does (the first,
    inline), they are read straight into the spool's buffer."""
    pairs = _samples(DatasetCodec.BYTEPLANE_ZSTD, 6)
    _write(tmp_path / "held", [s for s, _ in _samples_copy(pairs)], None)
    _left_in_file(tmp_path / "staged.bin", [s for s, _ in pairs[1:]])
    shard = _write(tmp_path / "streamed", [s for s, _ in pairs], Spooling(tmp_path / "streamed" / SHARDS, 1))
    assert shard.spool is not None and shard.spool.landed
    _same_shard(tmp_path / "held", tmp_path / "streamed")


def test_memory_held_falls_as_samples_reach_the_file(tmp_path: Path, small_chunks: None) -> None:
    shard = OpenShard(TOPIC, 0, Spooling(tmp_path / SHARDS, after_bytes=1))
    held = []
    for sample, _ in _samples(DatasetCodec.RAW, 8):
        shard.add(sample)
        held.append(shard.held_bytes - direct_file.CHUNK)
    # A raw sample here is 5,120 bytes: never more than a buffer's worth plus one sample stays held.
    assert max(held) <= direct_file.CHUNK + 5120 and shard.nbytes == 8 * 5120
    shard.discard()
    assert list((tmp_path / SHARDS).iterdir()) == []  # a dropped shard leaves no temp file


def test_a_spool_that_fails_midway_loses_no_sample(tmp_path: Path, small_chunks: None,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """The disk fills after three writes: the samples already in the file are
    read back from it, the rest were still held; the shard is the same."""
    pairs = _samples(DatasetCodec.BYTEPLANE_ZSTD, 10)
    _write(tmp_path / "held", [s for s, _ in _samples_copy(pairs)], None)
    writes = 0
    real_pwrite = os.pwrite

    def filling(fd: int, data: memoryview, offset: int) -> int:
        nonlocal writes
        writes += 1
        if writes > 3:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_pwrite(fd, data, offset)

    shard = OpenShard(TOPIC, 0, Spooling(tmp_path / "streamed" / SHARDS, 1))
    monkeypatch.setattr(direct_file.os, "pwrite", filling)
    for sample, _ in pairs:
        shard.add(sample)
    monkeypatch.setattr(direct_file.os, "pwrite", real_pwrite)
    assert shard.spool is not None and shard.spool.broken
    assert any(isinstance(s.hidden_states, FileRange) for s, _ in pairs)  # some were in the file already
    write_shard(LocalStorage(tmp_path / "streamed"), "streamed", shard)
    shard.discard()
    _same_shard(tmp_path / "held", tmp_path / "streamed")


def test_a_header_that_outgrows_its_room_is_written_again_from_the_spool(tmp_path: Path, small_chunks: None,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    pairs = _samples(DatasetCodec.BYTEPLANE_ZSTD, 6)
    _write(tmp_path / "held", [s for s, _ in _samples_copy(pairs)], None)
    shard = OpenShard(TOPIC, 0, Spooling(tmp_path / "streamed" / SHARDS, 1))
    for sample, _ in pairs:
        shard.add(sample)
    assert shard.spool is not None
    monkeypatch.setattr(shard.spool, "room", 8)  # as if the bound were wrong: no room at all
    monkeypatch.setattr(shard.spool, "land", lambda *a: pytest.fail("landed in too little room"))
    write_shard(LocalStorage(tmp_path / "streamed"), "streamed", shard)
    shard.discard()
    assert shard.spool.broken
    _same_shard(tmp_path / "held", tmp_path / "streamed")


def test_a_streamed_shard_closes_before_its_header_outgrows_the_room(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(spool_module, "MIN_ROOM", direct_file.ALIGN)
    shard = OpenShard(TOPIC, 0, Spooling(tmp_path / SHARDS, after_bytes=1, max_shard_bytes=1))
    pairs = _samples(DatasetCodec.BYTEPLANE_ZSTD, 20)
    taken = 0
    for sample, _ in pairs:
        if not shard.accepts(sample):
            break
        shard.add(sample)
        taken += 1
    assert shard.spool is not None and shard.spool.room == direct_file.ALIGN
    assert 1 < taken < len(pairs)
    write_shard(LocalStorage(tmp_path), "ds", shard)
    shard.discard()
    assert shard.spool.landed  # the bound held: it fit
    dataset = open_dataset(tmp_path)
    for sample, hidden in pairs[:taken]:
        assert_decoded(hidden, dataset[sample.manifest.request_id]["hidden_states"], DatasetCodec.BYTEPLANE_ZSTD)


def test_loading_a_partition_removes_the_temp_files_a_crash_left(tmp_path: Path) -> None:
    shards = tmp_path / SHARDS
    shards.mkdir()
    prefix = f"{TOPIC}-0003-"
    mine = shards / f".{prefix}{7:020d}.safetensors.abc.tmp"
    others = [shards / f".{TOPIC}-0004-{7:020d}.safetensors.abc.tmp",  # another partition
              shards / f".{TOPIC}-0003-x-0003-{7:020d}.safetensors.abc.tmp"]  # a topic named {TOPIC}-0003-x
    for path in (mine, *others):
        path.write_bytes(b"x")
    PartitionState.load(LocalStorage(tmp_path), TOPIC, 3, 60.0, spooling=Spooling(shards))
    assert not mine.exists() and all(path.exists() for path in others)


def test_a_shard_renamed_before_its_folder_synced_is_finished_by_the_retry(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """The folder's fsync fails after the rename: the write fails (nothing is
    announced) and the retry syncs the folder and goes on with the key file and
    the index, without writing the shard again."""
    pairs = _samples(DatasetCodec.BYTEPLANE_ZSTD, 4)
    _write(tmp_path / "held", [s for s, _ in _samples_copy(pairs)], None)
    shard = OpenShard(TOPIC, 0, Spooling(tmp_path / "streamed" / SHARDS, 1))
    for sample, _ in pairs:
        shard.add(sample)
    real_fsync = spool_module.fsync_path
    monkeypatch.setattr(spool_module, "fsync_path", lambda path: (_ for _ in ()).throw(OSError(errno.EIO, "EIO")))
    storage = LocalStorage(tmp_path / "streamed")
    with pytest.raises(OSError):
        write_shard(storage, "streamed", shard)
    assert shard.spool is not None and shard.spool.landed and not shard.spool.broken
    assert open_dataset(tmp_path / "streamed").request_ids() == []  # not indexed: not in the dataset
    monkeypatch.setattr(spool_module, "fsync_path", real_fsync)
    events = write_shard(storage, "streamed", shard)
    shard.discard()
    assert [e.request_id for e in events] == [s.manifest.request_id for s, _ in pairs]
    _same_shard(tmp_path / "held", tmp_path / "streamed")


def test_a_streamed_shard_leaves_no_page_in_the_page_cache(tmp_path: Path) -> None:
    """Streamed, head and tail included, around the page cache as a held shard is
    (tests/unit/test_direct_file.py has the buffered control)."""
    from tests.unit.test_direct_file import _resident_pages

    pairs = _samples(DatasetCodec.RAW, 6, tokens=400)  # 300 KB: the tail written at close, then the head
    shard = _write(tmp_path, [s for s, _ in pairs], Spooling(tmp_path / SHARDS, 1))
    assert shard.spool is not None and shard.spool.landed
    (path,) = (tmp_path / SHARDS).iterdir()
    assert _resident_pages(path) == 0


def test_samples_that_hold_no_memory_start_no_spool(tmp_path: Path) -> None:
    """A shard of samples left in a staging directory's files holds nothing: it
    is written when it closes, as before, however large."""
    pairs = _samples(DatasetCodec.BYTEPLANE_ZSTD, 3)
    _left_in_file(tmp_path / "staged.bin", [s for s, _ in pairs])
    shard = _write(tmp_path / "ds", [s for s, _ in pairs], Spooling(tmp_path / "ds" / SHARDS, 1))
    assert shard.spool is None and shard.held_bytes == 0
    dataset = open_dataset(tmp_path / "ds")
    for sample, hidden in pairs:
        assert_decoded(hidden, dataset[sample.manifest.request_id]["hidden_states"], DatasetCodec.BYTEPLANE_ZSTD)
