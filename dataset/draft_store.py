"""Where promoted drafts are published and followed: a directory, or
``s3://bucket/prefix`` so that a trainer in a pod of its own can promote to
serving pods that share no disk with it (:mod:`hsx.dataset.storage` underneath,
the ``AWS_*`` environment as for a dataset).

A gate publishes a draft in two steps (:meth:`DraftStore.publish`):

1. on an object store, the checkpoint's files (``config.json``, ``*.safetensors``)
   under ``v<version>/``, each object whole or absent (a directory's checkpoint
   is read where it lies);
2. the pointer ``promoted.json`` (:class:`~hsx.schemas.drafts.PromotedDraft`),
   replaced whole: a server that reads it finds every file it names.

A server polls the pointer (:meth:`DraftStore.pointer`) and loads a draft from a
local directory: :func:`local_copy` downloads one from an object store first.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

from hsx.dataset.storage import Storage, is_object_store, open_storage
from hsx.schemas.drafts import PROMOTED_FILE, PromotedDraft

DECISIONS = "decisions.jsonl"
"""The gate's decisions, one JSON object per line, beside the pointer."""
COPY_CHUNK = 8 << 20


def _draft_files(checkpoint: Path) -> list[Path]:
    return [checkpoint / "config.json", *sorted(checkpoint.glob("*.safetensors"))]


class DraftStore:
    """The drafts location ``location``: a directory (created) or an object store."""

    def __init__(self, location: str | Path) -> None:
        self.location = str(location).rstrip("/")
        self.remote = is_object_store(self.location)
        self._storage: Storage = open_storage(self.location, create=True)
        if not self.remote:
            Path(self.location).mkdir(parents=True, exist_ok=True)

    def pointer(self) -> bytes | None:
        """The pointer's bytes, or None where nothing was promoted yet."""
        try:
            return self._storage.read(PROMOTED_FILE)
        except FileNotFoundError:
            return None

    def promoted(self) -> PromotedDraft | None:
        """The pointer, its path made absolute (a directory or an ``s3://`` URL)."""
        data = self.pointer()
        if data is None:
            return None
        promoted = PromotedDraft.model_validate_json(data)
        return promoted.model_copy(update={"path": self.resolve(promoted.path)})

    def resolve(self, path: str) -> str:
        """A pointer's path, absolute: relative ones are the store's."""
        if is_object_store(path) or Path(path).is_absolute():
            return path
        return f"{self.location}/{path}" if self.remote else str(Path(self.location) / path)

    def publish(self, promoted: PromotedDraft, checkpoint: Path | None = None) -> PromotedDraft:
        """Steps 1-2: ``checkpoint``'s files first (on an object store, where
        ``promoted`` then points), then the pointer. Without ``checkpoint`` the
        pointer alone (a rollback names a draft published before)."""
        if checkpoint is not None and self.remote:
            folder = f"v{promoted.version}"
            for file in _draft_files(checkpoint):
                with file.open("rb") as source, self._storage.open_atomic(f"{folder}/{file.name}") as out:
                    while chunk := source.read(COPY_CHUNK):
                        out.write(chunk)
            promoted = promoted.model_copy(update={"path": folder})
        elif checkpoint is not None:
            promoted = promoted.model_copy(update={"path": str(checkpoint.resolve())})
        self._storage.write_atomic(PROMOTED_FILE, (promoted.model_dump_json(indent=2) + "\n").encode())
        return promoted

    def record(self, decision: dict[str, Any]) -> None:
        """Append one gate decision (one writer: the trainer)."""
        lines = self.decisions() + [decision]
        self._storage.write_atomic(DECISIONS, "".join(json.dumps(d) + "\n" for d in lines).encode())

    def decisions(self) -> list[dict[str, Any]]:
        """The gate's decisions so far, in order."""
        try:
            text = self._storage.read(DECISIONS).decode()
        except FileNotFoundError:
            return []
        return [json.loads(line) for line in text.splitlines()]


def local_copy(location: str, cache: Path, *, only: bool = False) -> Path:
    """A local directory holding the draft at ``location``: the directory itself,
    or an object store's draft downloaded under ``cache`` (once per location;
    a download a stop interrupted is never taken for a whole one). ``only``: the
    other drafts downloaded there are removed (a cache of one)."""
    if not is_object_store(location):
        return Path(location)
    target = cache / hashlib.sha256(location.encode()).hexdigest()[:16]
    if only and cache.is_dir():
        for other in cache.iterdir():
            if other != target:
                shutil.rmtree(other, ignore_errors=True)
    if target.is_dir():
        return target
    parent, folder = location.rstrip("/").rsplit("/", 1)
    storage = open_storage(parent)
    cache.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".draft-", dir=cache))
    try:
        for name in storage.list(folder):
            (staging / name.rsplit("/", 1)[-1]).write_bytes(storage.read(name))
        staging.rename(target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target
