"""The sink's reads of by-reference samples from a directory payload store: a
sample stored as its records came is verified from a reused buffer and left in
its staged file, so the sink holds none of its bytes; its shard, copied from the
file, reads back as the sample."""

from __future__ import annotations

from pathlib import Path

import torch

from hsx.dataset.encoding import read_hidden_states
from hsx.dataset.shard_reader import open_shard
from hsx.dataset.sample import FileRange, Sample
from hsx.dataset.shards import OpenShard, write_shard
from hsx.dataset.storage import LocalStorage
from hsx.schemas import Manifest
from hsx.schemas.dataset_codec import DatasetCodec
from hsx.sink.assembler import Assembler, RejectedRecords, Staged
from hsx.sink.payloads import PayloadReader
from tests.unit.test_assembler import records


def staged(store: LocalStorage, request_id: str, tokens: int) -> tuple[Staged, torch.Tensor]:
    """A by-reference manifest of ``tokens`` rows, its blocks staged in ``store``."""
    recs, hidden = records(request_id, tokens=tokens, per_block=4)
    manifest = Manifest.model_validate_json(recs[-1].value).by_reference()
    assert manifest.payload is not None
    store.write_atomic(manifest.payload.key, b"".join(r.value for r in recs[:-1]))
    return Staged(manifest, 0, manifest.model_dump_json().encode()), hidden


def fetch(reader: PayloadReader, stage: Staged, stored_as: DatasetCodec) -> Sample:
    sample = reader.fetch(stage, Assembler(stored_as=stored_as))
    assert isinstance(sample, Sample), sample
    return sample


def test_a_kept_sample_stays_in_its_staged_file_until_its_shard_copies_it(tmp_path: Path) -> None:
    store, dataset = LocalStorage(tmp_path / "staging"), LocalStorage(tmp_path / "dataset")
    reader = PayloadReader(store, fail=lambda error: None)
    shard = OpenShard("blocks", 0)
    hidden = {}
    for i, tokens in enumerate((10, 3, 10)):  # the buffer is reused: each sample must still be its own
        stage, hidden[f"r{i}"] = staged(store, f"r{i}", tokens)
        stage = Staged(stage.manifest, i, stage.value)
        sample = fetch(reader, stage, DatasetCodec.BYTEPLANE_ZSTD)
        assert isinstance(sample.hidden_states, FileRange) and sample.held_bytes == 0
        assert sample.hidden_states == FileRange(store.local_path(stage.manifest.payload.key), 0,  # type: ignore[union-attr]
                                                 stage.manifest.payload.nbytes)  # type: ignore[union-attr]
        shard.add(sample)
    assert shard.held_bytes == 0 and shard.nbytes == sum(len(s.hidden_states) for s in shard.samples)
    events = write_shard(dataset, "ds", shard)
    opened = open_shard(dataset, events[0].shard)
    for event in events:
        assert torch.equal(read_hidden_states(opened, event), hidden[event.request_id])


def test_a_sample_decoded_for_its_shard_gets_bytes_of_its_own(tmp_path: Path) -> None:
    store = LocalStorage(tmp_path / "staging")
    stage, hidden = staged(store, "r", 10)
    sample = fetch(PayloadReader(store, fail=lambda error: None), stage, DatasetCodec.RAW)
    assert bytes(sample.hidden_states) == hidden.numpy().tobytes() and sample.held_bytes == len(sample.hidden_states)


def test_an_object_larger_than_the_buffer_is_read_into_its_own(tmp_path: Path) -> None:
    store = LocalStorage(tmp_path / "staging")
    stage, _ = staged(store, "r", 10)
    sample = fetch(PayloadReader(store, fail=lambda error: None, buffer_max=100), stage, DatasetCodec.BYTEPLANE_ZSTD)
    assert not isinstance(sample.hidden_states, FileRange) and sample.held_bytes == stage.manifest.payload.nbytes  # type: ignore[union-attr]


def test_a_short_or_missing_staged_file_is_a_dead_letter(tmp_path: Path) -> None:
    store = LocalStorage(tmp_path / "staging")
    stage, _ = staged(store, "r", 10)
    path = store.local_path(stage.manifest.payload.key)  # type: ignore[union-attr]
    path.write_bytes(path.read_bytes()[:-1])
    reader = PayloadReader(store, fail=lambda error: None)
    short = reader.fetch(stage, Assembler(stored_as=DatasetCodec.BYTEPLANE_ZSTD))
    assert isinstance(short, RejectedRecords) and short.error_class == "payload_corrupt" and "shorter" in short.reason
    path.unlink()
    missing = reader.fetch(stage, Assembler(stored_as=DatasetCodec.BYTEPLANE_ZSTD))
    assert isinstance(missing, RejectedRecords) and missing.error_class == "payload_missing"
