"""The dataset storage never writes outside its root."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from hsx.dataset.storage import LocalStorage, UnsafePath


@pytest.mark.parametrize("relative", ["../escape", "/etc/passwd", "shards/../../x", "", "a/../../b"])
def test_paths_outside_the_root_are_refused(tmp_path: Path, relative: str) -> None:
    storage = LocalStorage(tmp_path / "ds")
    with pytest.raises(UnsafePath):
        storage.write_atomic(relative, b"x")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ds"]


def test_symlink_out_of_the_root_is_refused(tmp_path: Path) -> None:
    storage = LocalStorage(tmp_path / "ds")
    (tmp_path / "outside").mkdir()
    os.symlink(tmp_path / "outside", tmp_path / "ds" / "shards")
    with pytest.raises(UnsafePath):
        storage.write_atomic("shards/a.safetensors", b"x")
    assert list((tmp_path / "outside").iterdir()) == []


def test_atomic_write_replaces_and_leaves_no_temp_files(tmp_path: Path) -> None:
    storage = LocalStorage(tmp_path)
    storage.write_atomic("index/a.json", b"1")
    storage.write_atomic("index/a.json", b"22")
    assert storage.read("index/a.json") == b"22"
    assert storage.list("index") == ["index/a.json"]
    assert [p.name for p in (tmp_path / "index").iterdir()] == ["a.json"]
