"""Datasets on a real S3 server (the session's SeaweedFS, or ``HSX_TEST_S3_ENDPOINT``):
the storage contract the sink relies on, a dataset read back as from disk, and
the errors a user meets first (a wrong key, a missing bucket)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load
from torch.utils.data import DataLoader

from hsx.cli import main
from hsx.dataset.reader import open_dataset
from hsx.dataset.shard_reader import RemoteShard
from hsx.dataset.storage import LocalStorage, Storage, StorageRefused, open_storage
from hsx.dataset.storage import s3 as s3_storage
from hsx.local.s3service import S3Service
from hsx.local.training_data import TrainingDataSpec, write_training_dataset
from hsx.schemas.dataset_codec import DatasetCodec
from hsx.trainer import HsxDataset

pytestmark = [pytest.mark.integration]


@pytest.fixture(params=["local", "s3"])
def storage(request: pytest.FixtureRequest, tmp_path: Path) -> Storage:
    if request.param == "local":
        return LocalStorage(tmp_path / "dataset")
    return open_storage(request.getfixturevalue("s3_dataset_url"), part_bytes=s3_storage.MIN_PART_BYTES)


def test_the_storage_contract_holds_on_disk_and_in_s3(storage: Storage) -> None:
    storage.write_atomic("index/a.json", b"first")
    storage.write_atomic("index/a.json", b"second")  # replaced whole
    assert storage.read("index/a.json") == b"second" and storage.size("index/a.json") == 6

    big = torch.randint(0, 256, (12 << 20,), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    with storage.open_atomic("shards/big.bin") as out:  # three parts of 5 MiB on S3
        out.write(memoryview(big.numpy()))
    assert storage.read("shards/big.bin") == big.numpy().tobytes()
    with pytest.raises(RuntimeError), storage.open_atomic("shards/torn.bin") as out:
        out.write(memoryview(big.numpy()))
        raise RuntimeError("killed mid-write")
    assert "shards/torn.bin" not in storage.list("shards")  # whole or absent

    start, end = 5 << 20, (5 << 20) + 17
    near, empty, past = storage.read_ranges("shards/big.bin", [(start, end), (9, 9), ((12 << 20) - 3, 13 << 20)])
    assert bytes(near) == big.numpy()[start:end].tobytes() and bytes(empty) == b""
    assert bytes(past) == big.numpy()[-3:].tobytes()  # cut at the end

    for name in ["t-0001-0003", "t-0001-0001", "t-0001-0002", "t-0001-x-0001", "t-0002-0001", "t-00010-0001"]:
        storage.write_atomic(f"keys/{name}.keys", b"k")
    storage.write_atomic("keys/nested/t-0001-0009.keys", b"k")  # not directly under keys/
    assert storage.list("keys", starting="t-0001-") == [
        "keys/t-0001-0001.keys", "keys/t-0001-0002.keys", "keys/t-0001-0003.keys", "keys/t-0001-x-0001.keys"]
    assert storage.list("keys", starting="t-0001-", after="t-0001-0002.keys") == [
        "keys/t-0001-0003.keys", "keys/t-0001-x-0001.keys"]
    assert storage.list("nothing") == []

    storage.delete("keys/t-0001-0001.keys")
    storage.delete("keys/t-0001-0001.keys")  # absent: fine
    assert "keys/t-0001-0001.keys" not in storage.list("keys")
    with pytest.raises(FileNotFoundError):
        storage.read("keys/t-0001-0001.keys")


@pytest.mark.parametrize(("endpoint", "unsigned"), [("", True), ("https://minio.example:9000", True),
                                                    ("http://127.0.0.1:8333", False)])
def test_payloads_go_unsigned_over_tls_only(endpoint: str, unsigned: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("AWS_UNSIGNED_PAYLOAD", raising=False)
    assert s3_storage.store_config(endpoint).get("unsigned_payload", False) is unsigned
    monkeypatch.setenv("AWS_UNSIGNED_PAYLOAD", "false")  # the user's word is left to obstore
    assert s3_storage.store_config(endpoint) == {}


def test_the_server_takes_unsigned_payloads(s3_dataset_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """What goes over TLS in production (UNSIGNED-PAYLOAD), here over the test server's HTTP."""
    monkeypatch.setattr(s3_storage, "store_config", lambda endpoint: {"unsigned_payload": True})
    storage = open_storage(f"{s3_dataset_url}/unsigned", part_bytes=s3_storage.MIN_PART_BYTES)
    assert storage.store.config.get("unsigned_payload") == "true"  # type: ignore[attr-defined]
    data = torch.randint(0, 256, (11 << 20,), dtype=torch.uint8, generator=torch.Generator().manual_seed(2))
    with storage.open_atomic("shards/unsigned.bin") as out:  # a multipart upload of three parts
        out.write(memoryview(data.numpy()))
    storage.write_atomic("index/unsigned.json", b"{}")
    assert storage.read("shards/unsigned.bin") == data.numpy().tobytes()
    assert storage.read("index/unsigned.json") == b"{}"


def test_a_listing_of_many_pages_is_followed_and_cut_short(s3_dataset_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(s3_storage, "_LIST_PAGE", 2)
    storage = open_storage(s3_dataset_url)
    names = [f"p-0001-{i:04d}" for i in range(7)] + [f"p-0002-{i:04d}" for i in range(5)]
    for name in names:
        storage.write_atomic(f"index/{name}.json", b"{}")
    assert storage.list("index", starting="p-0001-") == [f"index/{n}.json" for n in names[:7]]
    assert storage.list("index", starting="p-0002-", after="p-0002-0002.json") == [
        f"index/{n}.json" for n in names[10:]]


@pytest.mark.parametrize("codec", [DatasetCodec.RAW, DatasetCodec.BYTEPLANE_ZSTD])
def test_a_dataset_in_s3_reads_as_the_same_dataset_on_disk(s3_dataset_url: str, tmp_path: Path,
                                                            codec: DatasetCodec) -> None:
    spec = TrainingDataSpec(samples=23, per_shard=4, codec=codec)
    write_training_dataset(tmp_path / "disk", spec, partitions=2)
    write_training_dataset(open_storage(s3_dataset_url), spec, partitions=2)
    disk, remote = open_dataset(tmp_path / "disk"), open_dataset(s3_dataset_url)
    assert remote.request_ids() == disk.request_ids() and len(remote) == 23
    in_order = list(remote)  # index order: a shard's samples fetched together
    for sample, request_id in zip(in_order, disk.request_ids(), strict=True):
        want = disk[request_id]
        for got in (sample, remote[request_id]):  # read in order, and at random
            assert got["request_id"] == request_id
            assert torch.equal(got["token_ids"], want["token_ids"])
            assert got["hidden_states"].dtype == want["hidden_states"].dtype
            assert torch.equal(got["hidden_states"].view(torch.uint8), want["hidden_states"].view(torch.uint8))
            assert (got["loss_mask"] is None) == (want["loss_mask"] is None)
            assert got["loss_mask"] is None or torch.equal(got["loss_mask"], want["loss_mask"])
            assert got["metadata"] == want["metadata"]


def test_ranged_reads_return_exactly_what_a_whole_object_read_returns(s3_dataset_url: str) -> None:
    storage = open_storage(s3_dataset_url)
    events = write_training_dataset(storage, TrainingDataSpec(samples=9, per_shard=9, max_tokens=300))
    whole = load(storage.read(events[0].shard))
    shard = RemoteShard(storage, events[0].shard)
    assert sorted(shard.keys()) == sorted(whole)
    shard.prefetch(list(whole)[:5])
    for name, tensor in whole.items():
        assert torch.equal(shard.get_tensor(name), tensor), name


def test_a_trainer_loads_an_s3_dataset_with_dataloader_workers(s3_dataset_url: str, tmp_path: Path) -> None:
    spec = TrainingDataSpec(samples=12, per_shard=5)
    write_training_dataset(tmp_path / "disk", spec)
    write_training_dataset(open_storage(s3_dataset_url), spec)
    disk, remote = HsxDataset(tmp_path / "disk"), HsxDataset(s3_dataset_url)
    # Each worker makes its own S3 client; obstore's runtime cannot be forked.
    loader = DataLoader(remote, batch_size=None, num_workers=2, multiprocessing_context="forkserver")
    got = list(loader)
    assert len(got) == len(disk) > 0
    for i, sample in enumerate(got):
        assert torch.equal(sample.hidden_states, disk[i].hidden_states)
        assert torch.equal(sample.input_ids, disk[i].input_ids) and torch.equal(sample.loss_mask, disk[i].loss_mask)
    for i in range(len(remote)):  # in this process too; each read takes all the bytes it fetched
        assert torch.equal(remote[i].hidden_states, disk[i].hidden_states)
    assert all(not shard._fetched for shard in remote._shards._open.values())
    with pytest.raises(Exception, match=r"forked after its parent read or wrote s3://.*forkserver"):
        list(DataLoader(remote, batch_size=None, num_workers=1, multiprocessing_context="fork"))  # fails, never hangs


def test_a_wrong_key_and_a_missing_bucket_are_refused_in_one_line(
        s3_server: S3Service, s3_dataset_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    wrong = s3_server.with_keys(secret_key="not-the-secret-key-at-all")
    for name, value in wrong.environ().items():
        monkeypatch.setenv(name, value)
    with pytest.raises(StorageRefused, match=r"refused by .* check AWS_ACCESS_KEY_ID") as refused:
        open_storage(s3_dataset_url)
    assert "not-the-secret-key-at-all" not in str(refused.value) and s3_dataset_url in str(refused.value)
    assert "\n" not in str(refused.value)

    for name, value in s3_server.environ().items():
        monkeypatch.setenv(name, value)
    with pytest.raises(StorageRefused, match=r"bucket 'hsx-no-such-bucket' does not exist at http"):
        open_storage("s3://hsx-no-such-bucket/data")


@pytest.mark.parametrize("argv", [["inspect", "s3://hsx-no-such-bucket/data"],
                                  ["export", "{tmp}/out", "--dataset", "s3://hsx-no-such-bucket/data"]])
def test_readers_name_a_missing_bucket_in_one_line(argv: list[str], s3_env: dict[str, str], tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str],
                                                    restore_root_logging: None) -> None:
    assert main([word.replace("{tmp}", str(tmp_path)) for word in argv]) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert f"hsx {argv[0]}: s3://hsx-no-such-bucket/data: bucket 'hsx-no-such-bucket' does not exist" in err, err
