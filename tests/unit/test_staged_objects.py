"""The sink's cleanup of staged objects (``sink/payloads.py``, step 5): an object
goes at the commit after its sample is durable; a duplicate's with its first
copy; a lost partition's are left to the sweep. Real files, no broker."""

from __future__ import annotations

from pathlib import Path

from hsx.dataset.storage import LocalStorage
from hsx.schemas import Manifest
from hsx.sink.payloads import StagedObjects
from tests.unit.test_assembler import records

TP = ("hidden_states.blocks", 0)


def _staged(store: LocalStorage, request_id: str) -> Manifest:
    """A by-reference manifest of ``request_id`` and its staged object."""
    manifest = Manifest.model_validate_json(records(request_id, tokens=4)[0][-1].value).by_reference()
    assert manifest.payload is not None
    store.write_atomic(manifest.payload.key, b"blocks")
    return manifest


def _left(store: LocalStorage) -> set[str]:
    return set(store.stale(".blocks", older_than=-3600))


def test_a_duplicate_of_a_copy_not_yet_written_goes_with_that_copy(tmp_path: Path) -> None:
    store = LocalStorage(tmp_path)
    first, duplicate, other = _staged(store, "r"), _staged(store, "r"), _staged(store, "s")
    staged = StagedObjects(store, max_age=3600)
    staged.add_with_copy(TP, duplicate)
    staged.add(TP, [other])  # another request's shard is durable
    staged.delete()
    assert _left(store) == {first.payload.key, duplicate.payload.key}  # type: ignore[union-attr]
    staged.add(TP, [first])  # the first copy's shard is durable: the duplicate's object goes too
    staged.delete()
    assert _left(store) == set()


def test_a_lost_partition_leaves_its_objects_to_the_sweep(tmp_path: Path) -> None:
    store = LocalStorage(tmp_path)
    stored, duplicate = _staged(store, "r"), _staged(store, "s")
    staged = StagedObjects(store, max_age=3600)
    staged.add(TP, [stored])
    staged.add_with_copy(TP, duplicate)
    staged.forget(TP)
    staged.add(TP, [Manifest.model_validate_json(records("s", tokens=4)[0][-1].value)])  # an inline first copy
    staged.delete()
    assert _left(store) == {stored.payload.key, duplicate.payload.key}  # type: ignore[union-attr]
