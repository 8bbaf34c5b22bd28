"""trainer/ without a broker: the map-style dataset under DataLoader workers, the
layer layout, the two collate layouts, the consumed-offset frontier, and the
speculators export's options."""

from __future__ import annotations

import json
import logging
import pickle
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader

from hsx.cli import main
from hsx.dataset.reader import open_dataset
from hsx.local.training_data import TrainingDataSpec, write_training_dataset
from hsx.schemas.training import OnlineLoaderState
from hsx.trainer import HsxDataset, PackedCollate, PaddedCollate, ReadyStream, choose_layers
from hsx.trainer.export import token_frequencies
from hsx.trainer.offsets import Position, Progress


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("trainer") / "ds"
    write_training_dataset(root, TrainingDataSpec(samples=20, unsupervised_every=6), partitions=2)
    return root


def test_dataloader_with_two_workers_yields_exactly_the_samples(dataset: Path) -> None:
    ds = HsxDataset(dataset)
    source = open_dataset(dataset)
    loader = DataLoader(ds, batch_size=3, shuffle=True, num_workers=2, collate_fn=list)
    seen = [s for batch in loader for s in batch]
    assert sorted(s.request_id for s in seen) == sorted(ds.event(i).request_id for i in range(len(ds)))
    assert len(ds) == 20 - ds.dropped and ds.dropped == 3
    for sample in seen:
        stored = source[sample.request_id]
        assert torch.equal(sample.hidden_states, stored["hidden_states"])
        assert torch.equal(sample.input_ids, stored["token_ids"])
        expected = torch.ones(sample.num_tokens) if stored["loss_mask"] is None else stored["loss_mask"]
        assert torch.equal(sample.loss_mask, expected.to(torch.int64)) and sample.loss_mask.any()


def test_rows_and_request_ids_name_the_same_sample(dataset: Path) -> None:
    ds = HsxDataset(dataset, layers=[3, 1])
    rid = ds.event(5).request_id
    assert ds[rid].request_id == ds[5].request_id == rid and ds.row(rid) == 5
    stored = open_dataset(dataset)[rid]["hidden_states"]
    assert torch.equal(ds[5].hidden_states, stored[:, [2, 0, 3]])  # slots: layers 3, 1, then the last (4)
    assert ds.lengths[5] == ds[5].num_tokens
    with pytest.raises(KeyError, match="no trainable sample 'nope'"):
        ds["nope"]
    copy = pickle.loads(pickle.dumps(ds))  # what a spawned worker gets: no open shard travels
    assert torch.equal(copy[5].hidden_states, ds[5].hidden_states)


def test_loss_mask_none_drops_plain_text(dataset: Path) -> None:
    ds = HsxDataset(dataset, loss_mask="none")
    assert all(ds.event(i).tensors.loss_mask is not None for i in range(len(ds)))
    assert len(ds) + ds.dropped == 20 and len(ds) < len(HsxDataset(dataset))


@pytest.mark.parametrize("aux, message", [
    ([2, 2], "listed twice"), ([7], "layer 7 is not stored"), ([1, 4], "4 is the verifier's last layer"),
    ([], "at least one aux layer")])
def test_bad_layer_choices_are_one_line(aux: list[int], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        choose_layers([1, 2, 3, 4], aux)


def test_aux_layers_out_of_layer_order_are_warned_of(caplog: pytest.LogCaptureFixture) -> None:
    """vLLM feeds a draft its aux hidden states in layer order: a draft trained
    on another order would see them permuted when served."""
    with caplog.at_level(logging.WARNING, logger="hsx.trainer.samples"):
        assert choose_layers([1, 2, 3, 4], [3, 2, 1]).aux == (3, 2, 1)
        choose_layers([1, 2, 3, 4], [1, 2, 3])
    assert [r.getMessage().split(";")[0] for r in caplog.records] == ["--layers 3,2,1: not ascending"]


def test_other_than_three_aux_layers_are_warned_of(caplog: pytest.LogCaptureFixture) -> None:
    """vLLM sizes a speculators draft's input for 3 aux layers."""
    with caplog.at_level(logging.WARNING, logger="hsx.trainer.samples"):
        choose_layers([1, 2, 3, 4], [1, 3])
    assert [r.getMessage().split(";")[0] for r in caplog.records] == ["--layers 1,3: 2 aux layers"]


def test_an_unknown_storage_scheme_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"gs:// is not supported \(s3:// or a local path\)"):
        HsxDataset("gs://bucket/hs")


def test_packed_collate_cuts_at_total_length(dataset: Path) -> None:
    ds = HsxDataset(dataset)
    samples = [ds[i] for i in range(4)]
    total = samples[0].num_tokens + samples[1].num_tokens + 2
    batch = PackedCollate(total, torch.bfloat16)(samples)
    assert batch["lengths"].tolist() == [samples[0].num_tokens, samples[1].num_tokens, 2]
    assert batch["hidden_states"].shape == (1, total, 3 * 16) and batch["hidden_states"].dtype == torch.bfloat16
    a, b = samples[0].num_tokens, samples[1].num_tokens
    assert torch.equal(batch["verifier_last_hidden_states"][0, a:a + b], samples[1].hidden_states[:, -1].bfloat16())
    assert torch.equal(batch["hidden_states"][0, :a, 16:32], samples[0].hidden_states[:, 1].bfloat16())
    assert batch["position_ids"][0, a:a + 3].tolist() == [0, 1, 2]
    assert batch["document_ids"][0].tolist() == [0] * a + [1] * b + [2, 2]


def test_padded_collate_pads_each_row(dataset: Path) -> None:
    ds = HsxDataset(dataset)
    samples = [ds[i] for i in range(3)]
    batch = PaddedCollate(torch.float32, pad_token_id=-1)(samples)
    longest = max(s.num_tokens for s in samples)
    assert batch["input_ids"].shape == (3, longest) and batch["lengths"].tolist() == [s.num_tokens for s in samples]
    for i, s in enumerate(samples):
        n = s.num_tokens
        assert torch.equal(batch["input_ids"][i, :n], s.input_ids) and (batch["input_ids"][i, n:] == -1).all()
        assert batch["attention_mask"][i].sum() == n and (batch["loss_mask"][i, n:] == 0).all()
        assert torch.equal(batch["verifier_last_hidden_states"][i, :n], s.hidden_states[:, -1])


def test_progress_commits_only_the_consumed_prefix() -> None:
    progress = Progress()
    # Out of order, as a shuffle buffer hands them out; offset 3 is a transaction marker, covered by 4's range.
    progress.consume([Position(0, 0, 2, 2), Position(0, 0, 3, 4)])
    assert [(tp.partition, tp.offset) for tp in progress.to_commit("t")] == [(0, 0)]
    progress.consume([Position(0, 0, 0, 0), Position(0, 0, 1, 1)])
    assert [tp.offset for tp in progress.to_commit("t")] == [5]
    progress.consume([Position(0, 0, 7, 7)])
    state = progress.state("t", "g")
    assert state.partitions[0].next_offset == 5 and state.partitions[0].consumed == [7]
    resumed = Progress.from_state(OnlineLoaderState.model_validate_json(state.model_dump_json()))
    assert resumed.start(0) == (5, {7}) and resumed.start(1) is None


def test_token_frequencies_count_supervised_tokens_only() -> None:
    pairs = [(torch.tensor([5, 6, 5, 9]), torch.tensor([0, 1, 1, 1])), (torch.tensor([6, 6]), torch.tensor([1, 0]))]
    assert token_frequencies(iter(pairs)) == {5: 1, 6: 2, 9: 1}


@pytest.mark.usefixtures("restore_root_logging")
def test_export_cli_writes_metadata_and_drops_unsupervised(dataset: Path, tmp_path: Path,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["export", str(tmp_path / "out"), "--dataset", str(dataset), "--layers", "3,1",
                 "--loss-mask", "none"]) == 0
    out = capsys.readouterr().out
    meta = json.loads((tmp_path / "out" / "hsx_export.json").read_text())
    kept = len(HsxDataset(dataset, loss_mask="none"))
    assert meta["rows"] == kept and meta["dropped_unsupervised"] == 20 - kept and meta["layer_ids"] == [3, 1, 4]
    assert f"exported {kept} samples" in out and f"{20 - kept} without a supervised token dropped" in out
    assert "--target-layer-ids 3 1 " in out and f"--data-path {tmp_path / 'out'}" in out
    assert len(list((tmp_path / "out" / "hidden_states").iterdir())) == kept


@pytest.mark.usefixtures("restore_root_logging")
def test_export_cli_refuses_bad_layers(dataset: Path, tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    assert main(["export", str(tmp_path / "out"), "--dataset", str(dataset), "--layers", "2,9"]) == 2
    assert "layer 9 is not stored (the dataset holds 1,2,3,4)" in capfd.readouterr().err
    with pytest.raises(SystemExit) as exited:  # argparse's own exit, code 2
        main(["export", str(tmp_path / "out"), "--dataset", str(dataset), "--layers", "a,b"])
    assert exited.value.code == 2 and "argument --layers: 'a,b': comma-separated layer ids" in capfd.readouterr().err
    assert not (tmp_path / "out").exists()


def test_progress_follows_a_worker_that_began_at_a_later_commit() -> None:
    progress = Progress.from_state(OnlineLoaderState(topic="t", group_id="g", partitions=[]))
    progress.consume([Position(0, 0, 0, 1)])
    progress.consume([Position(0, 10, 12, 12)])  # a later epoch's worker, resumed at the commit 10
    state = progress.state("t", "g").partitions[0]
    assert (state.next_offset, state.consumed) == (10, [12])


@pytest.mark.parametrize("position, problem", [
    ({"partition": 2**31, "next_offset": 0}, "partitions.0.partition: Input should be less than or equal to 2147483647"),
    ({"partition": 0, "next_offset": 2**63}, "partitions.0.next_offset: Input should be less than or equal to"),
    ({"partition": 0, "next_offset": 0, "consumed": [2**63]}, "partitions.0.consumed.0: Input should be less"),
])
def test_a_loader_state_beyond_kafkas_numbers_is_refused(tmp_path: Path, position: dict, problem: str) -> None:
    """A loaded state becomes commits and resume points: a partition or offset
    Kafka's client cannot hold is refused when loaded, not an OverflowError at
    the next commit."""
    stream = ReadyStream("localhost:9", tmp_path, group_id="g", topic="t")
    with pytest.raises(ValueError, match=f"loader state: {problem}"):
        stream.load_state_dict({"topic": "t", "group_id": "g", "partitions": [position]})
