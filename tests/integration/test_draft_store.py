"""The drafts store a gate promotes to and servers follow, in a directory and on a
real S3 server: a promoted checkpoint's bytes are what a server loads, the
pointer names it only once all of it is there, a rollback re-points without a
copy, and a server's scheduler side takes up a pointer that changed."""

from __future__ import annotations

from pathlib import Path

import pytest

from hsx.dataset.draft_store import DraftStore, local_copy
from hsx.extractor.connector import draft_swap
from hsx.extractor.connector.draft_swap import SwapPlan
from hsx.schemas.drafts import PromotedDraft

pytestmark = pytest.mark.integration


@pytest.fixture(params=["directory", "s3"])
def location(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "directory":
        return str(tmp_path / "drafts")
    return str(request.getfixturevalue("s3_dataset_url"))


def _checkpoint(path: Path, seed: int) -> Path:
    path.mkdir(parents=True)
    (path / "config.json").write_text(f'{{"seed": {seed}}}')
    (path / "model.safetensors").write_bytes(bytes(range(256)) * (1000 + seed))
    (path / "optimizer.pt").write_bytes(b"not a draft's")  # training state: never published
    return path


def test_a_promoted_draft_is_what_a_server_loads(location: str, tmp_path: Path) -> None:
    store = DraftStore(location)
    assert store.promoted() is None and store.decisions() == []
    first = _checkpoint(tmp_path / "trained" / "0", seed=1)
    published = store.publish(PromotedDraft(version=1, path=str(first), reason="gate"), first)
    pointer = store.promoted()
    assert pointer is not None and pointer.version == 1 and pointer.reason == "gate"
    assert pointer.path == (f"{location}/v1" if store.remote else str(first.resolve()))
    assert published.path == ("v1" if store.remote else str(first.resolve()))  # relative on a store: it can move
    copy = local_copy(pointer.path, tmp_path / "cache")
    if store.remote:  # the draft's files, not the trainer's state beside them
        assert sorted(f.name for f in copy.iterdir()) == ["config.json", "model.safetensors"]
    else:  # read where it lies
        assert copy == first.resolve()
    assert all((copy / f).read_bytes() == (first / f).read_bytes() for f in ("config.json", "model.safetensors"))
    store.publish(PromotedDraft(version=2, path="/models/draft", reason="rollback of 1"))  # the pointer alone
    assert store.promoted() == PromotedDraft(version=2, path="/models/draft", reason="rollback of 1")
    store.record({"outcome": "promoted", "version": 1})
    store.record({"outcome": "kept", "version": 2})
    assert [d["outcome"] for d in DraftStore(location).decisions()] == ["promoted", "kept"]


def test_a_download_is_kept_once_and_a_cache_of_one_forgets_the_others(s3_dataset_url: str, tmp_path: Path) -> None:
    store = DraftStore(s3_dataset_url)
    urls = [store.resolve(store.publish(PromotedDraft(version=v, path="x"), _checkpoint(tmp_path / str(v), v)).path)
            for v in (1, 2)]
    cache = tmp_path / "cache"
    one = local_copy(urls[0], cache)
    assert local_copy(urls[0], cache) == one  # not fetched again
    two = local_copy(urls[1], cache, only=True)
    assert [p.name for p in cache.iterdir()] == [two.name]
    assert (two / "config.json").read_text() == '{"seed": 2}'


def test_a_server_takes_up_a_changed_pointer(location: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(draft_swap, "POLL_SECONDS", 0.0)
    monkeypatch.setattr(draft_swap, "REMOTE_POLL_SECONDS", 0.0)
    plan = SwapPlan(location, lambda _: None)
    assert plan.step() == (None, None)
    DraftStore(location).publish(PromotedDraft(version=1, path="x"), _checkpoint(tmp_path / "one", 1))
    prepare, _ = plan.step()
    assert prepare is not None and prepare.version == 1
    assert prepare.path == (f"{location}/v1" if location.startswith("s3://") else str((tmp_path / "one").resolve()))
