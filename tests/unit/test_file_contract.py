"""The connector's file contract without an engine: which file a request gets
(never outside the root, whatever the client sends), how the extra config is
read, and the lock protocol a reader relies on (the lock held until the whole
file is under its final name; a failed write leaves no file and no held lock)."""

from __future__ import annotations

import fcntl
import os
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from hsx.extractor.connector.request_options import read_request, served_params
from hsx.extractor.connector.files import FileWriter
from hsx.extractor.connector.gather import Gathered
from hsx.schemas.common import safe_name
from hsx.schemas.connector import FilesConfig, read_extra_config

HOSTILE = ["../../x", "a/b", "..", ".", "", "\x00", "x" * 10_000, "/etc/passwd", "HumanEval/0", "é", ".hidden",
           "a..b"]


@pytest.mark.parametrize("identifier", HOSTILE)
def test_safe_names_are_plain_names(identifier: str) -> None:
    name = safe_name(identifier)
    assert 0 < len(name) <= 128 and "/" not in name and "\x00" not in name and ".." not in name
    assert not name.startswith(".")


def test_safe_names_keep_plain_ids_and_never_share_a_name() -> None:
    assert safe_name("cmpl-abc_1.2-0-d3adb33f") == "cmpl-abc_1.2-0-d3adb33f"
    names = {safe_name(i) for i in [*HOSTILE, "a_b", "a/b/", "a\\b", "x" * 10_001]}
    assert len(names) == len(HOSTILE) + 4


def test_the_extra_config_names_its_sides_and_refuses_the_rest() -> None:
    files = read_extra_config({"shared_storage_path": "/d", "allow_custom_save_path": "true"})
    assert files.kafka is None and files.files == FilesConfig(shared_storage_path="/d", allow_custom_save_path=True)
    with pytest.raises(ValueError, match="needs shared_storage_path .* or 'hsx'"):
        read_extra_config({})
    with pytest.raises(ValueError, match=r"unknown keys \['shared_storage'\]"):
        read_extra_config({"shared_storage": "/d"})
    with pytest.raises(ValueError, match="not shared_storage_path"):
        read_extra_config({"hsx": None, "num_writer_threads": 2})


def _file(config: FilesConfig, engine_id: str, kv_params: dict[str, object]) -> str | None:
    return read_request(engine_id, kv_params, files=config, served=True).file


def test_a_file_is_named_by_the_request_inside_the_root(tmp_path: Path) -> None:
    config = FilesConfig(shared_storage_path=str(tmp_path))
    for engine_id in HOSTILE[:-1]:
        path = _file(config, engine_id, {})
        assert path is not None and Path(path).parent == tmp_path


def test_what_a_served_request_asks_for(tmp_path: Path) -> None:
    config = FilesConfig(shared_storage_path=str(tmp_path))
    assert read_request("r", {"hsx": {"capture": False}}, files=config, served=True).file is None
    last = read_request("r", {"hsx": {"capture": "last", "metadata": {"k": [1]}}}, files=None, served=True)
    assert last.capture == "last" and last.metadata == {"k": [1]} and last.file is None
    bad = read_request("r", {"hsx": {"capture": "x", "extra": 1}}, files=config, served=True)
    assert bad.capture is None and bad.file is None and "capture" in (bad.error or "") and "extra" in (bad.error or "")
    # The extractor's own parameters are not a client's: only their capture counts.
    extractor = read_request("r", {"hsx": {"request_id": "a", "capture": "last"}}, files=config, served=False)
    assert extractor.capture == "last" and extractor.error is None


def test_a_served_sample_keeps_the_id_the_client_sent() -> None:
    asked = read_request("cmpl-../x-0-ab", {"hsx": {"metadata": {"a": 1}}}, files=None, served=True)
    params = served_params("srv", "srv-1", "cmpl-../x-0-ab" + "y" * 5000, asked)
    assert params["request_id"] == "srv-1" and params["metadata"] == {"a": 1}
    assert params["source"]["server"] == "srv" and params["source"]["request_id"].startswith("cmpl-../x-0-ab")
    assert len(params["source"]["request_id"]) == 1024


def test_a_chosen_path_needs_the_operator_and_stays_inside(tmp_path: Path) -> None:
    default = str(tmp_path / "r.safetensors")
    closed = FilesConfig(shared_storage_path=str(tmp_path))
    assert _file(closed, "r", {"hidden_states_path": "mine.safetensors"}) == default
    open_ = FilesConfig(shared_storage_path=str(tmp_path), allow_custom_save_path=True)
    inside = _file(open_, "r", {"hidden_states_path": "sub/mine.safetensors"})
    assert inside == str(tmp_path / "sub" / "mine.safetensors")
    (tmp_path / "link").symlink_to("/tmp")
    for escape in ["/etc/x.safetensors", "../x.safetensors", "link/x.safetensors", "sub/../../x.safetensors",
                   "x.txt", "a\x00.safetensors", 7]:
        assert _file(open_, "r", {"hidden_states_path": escape}) == default


def _writer(tmp_path: Path) -> FileWriter:
    return FileWriter(FilesConfig(shared_storage_path=str(tmp_path), num_writer_threads=1))


def _locked(path: str) -> bool:
    with open(path + ".lock") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        return False


def test_the_lock_is_held_until_the_whole_file_has_its_name(tmp_path: Path) -> None:
    writer, path = _writer(tmp_path), str(tmp_path / "r.safetensors")
    writer.hold(path)
    assert _locked(path) and not os.path.exists(path)
    ready = threading.Event()
    rows = torch.randn(5, 3, 8)

    class SlowCopy(Gathered):  # a device copy that takes its time: the reader must wait it out
        def wait(self) -> torch.Tensor:
            ready.wait(10)
            return super().wait()

    writer.write("engine-r", path, SlowCopy(rows), [1, 2, 3, 4, 5])
    time.sleep(0.2)
    assert _locked(path) and not os.path.exists(path) and writer.take_copied() == set()
    ready.set()
    with open(path + ".lock") as lock:
        fcntl.flock(lock, fcntl.LOCK_SH)  # as vLLM's load_hidden_states: sleeps until the writer is done
        data = load_file(path)
    assert torch.equal(data["hidden_states"], rows) and data["token_ids"].tolist() == [1, 2, 3, 4, 5]
    assert writer.take_copied() == {"engine-r"} and writer.stats.written == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.safetensors", "r.safetensors.lock"]
    writer.close()


def test_a_failed_write_leaves_no_file_and_no_lock(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    writer, path = _writer(tmp_path), str(tmp_path / "r.safetensors")
    writer.hold(path)

    def disk_full(*_: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("hsx.extractor.connector.files.save_file", disk_full)
    writer.write("engine-r", path, Gathered(torch.zeros(2, 1, 4)), [1, 2])
    writer.close()
    assert list(tmp_path.iterdir()) == [] and writer.stats.failed == 1 and writer.take_copied() == {"engine-r"}


def test_pending_bytes_are_bounded_but_one_request_always_fits(tmp_path: Path) -> None:
    writer = FileWriter(FilesConfig(shared_storage_path=str(tmp_path), max_pending_file_bytes=1 << 20))
    assert writer.has_room(10 << 20)
    gate = threading.Event()

    class Held(Gathered):
        def wait(self) -> torch.Tensor:
            gate.wait(10)
            return super().wait()

    writer.write("a", str(tmp_path / "a.safetensors"), Held(torch.zeros(1 << 18)), [1])  # 1 MiB pending
    assert not writer.has_room(1)
    gate.set()
    writer.close()
    assert writer.has_room(1 << 20)


def test_files_past_their_ttl_are_swept_with_their_unheld_locks(tmp_path: Path) -> None:
    writer = FileWriter(FilesConfig(shared_storage_path=str(tmp_path), files_ttl_s=60))
    for name in ("a", "b"):
        path = str(tmp_path / f"{name}.safetensors")
        writer.hold(path)
        writer.write(name, path, Gathered(torch.zeros(4, 1, 8)), [1, 2, 3, 4])
    writer.close()
    os.unlink(tmp_path / "b.safetensors")  # a reader took b
    sweeper = writer._sweeper
    sweeper.sweep()
    assert sweeper.bytes == (tmp_path / "a.safetensors").stat().st_size
    with open(tmp_path / "a.safetensors.lock") as reader:  # a reader mid-read keeps its lock file
        fcntl.flock(reader, fcntl.LOCK_SH)
        sweeper.sweep(now=time.time() + 61)
    assert not (tmp_path / "a.safetensors").exists() and (tmp_path / "a.safetensors.lock").exists()
    assert sweeper.bytes == 0


def test_a_file_past_the_byte_bound_is_refused_not_written(tmp_path: Path) -> None:
    reports: list[object] = []
    config = FilesConfig(shared_storage_path=str(tmp_path), files_max_bytes=1 << 20, num_writer_threads=1)
    (tmp_path / "old.safetensors").write_bytes(b"x" * 700_000)  # a previous run's, found at start
    writer = FileWriter(config, reports.append)
    for name in ("fits", "over"):
        path = str(tmp_path / f"{name}.safetensors")
        writer.hold(path)
        writer.write(name, path, Gathered(torch.zeros(1, 1, 50_000)), [1])  # 200 KB each
    writer.close()
    assert (tmp_path / "fits.safetensors").exists()
    assert not (tmp_path / "over.safetensors").exists() and not (tmp_path / "over.safetensors.lock").exists()
    ok, refused = reports
    assert ok.ok and not refused.ok and "files_max_bytes" in refused.error  # type: ignore[attr-defined]
    assert writer.take_copied() == {"fits", "over"}  # refused captures give their blocks back too


def test_captures_a_dead_server_promised_are_counted_by_the_next(tmp_path: Path) -> None:
    (tmp_path / "written.safetensors").write_bytes(b"x")
    (tmp_path / "written.safetensors.lock").touch()  # released: its file was written
    (tmp_path / "lost.safetensors.lock").touch()  # the server died before writing it
    (tmp_path / ".cut.safetensors.0123456789ab.tmp").write_bytes(b"half")  # a write the kill cut off
    held = open(tmp_path / "busy.safetensors.lock", "w")  # another live server's write  # noqa: SIM115
    fcntl.flock(held, fcntl.LOCK_EX)
    (tmp_path / ".busy.safetensors.ba9876543210.tmp").write_bytes(b"being written")
    reports: list[object] = []
    writer = FileWriter(FilesConfig(shared_storage_path=str(tmp_path)), reports.append)
    writer.close()
    held.close()
    (report,) = reports
    assert report.path == str(tmp_path / "lost.safetensors") and not report.ok  # type: ignore[attr-defined]
    assert report.earlier and "died before writing" in report.error  # type: ignore[attr-defined]
    assert sorted(p.name for p in tmp_path.iterdir()) == [".busy.safetensors.ba9876543210.tmp",
                                                          "busy.safetensors.lock", "written.safetensors",
                                                          "written.safetensors.lock"]
