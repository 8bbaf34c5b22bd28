"""Promoted drafts taken up by a running engine, between two of its steps, with
no restart: the connector's scheduler side (:class:`SwapPlan`) and worker side
(:class:`DraftSwapper`), joined by what vLLM hands between them every step (the
connector's metadata one way, its worker metadata, :class:`DraftWorkerMeta`,
the other), so that every rank swaps in the same step:

1. The scheduler side reads the drafts store's pointer
   (:class:`~hsx.schemas.drafts.PromotedDraft`, :mod:`hsx.dataset.draft_store`: a
   directory, at most once a second, or ``s3://``, every
   :data:`REMOTE_POLL_SECONDS`); a version other than the one served is handed
   to every worker to *prepare*.
2. Each worker loads that checkpoint on a thread of its own (from an object
   store: downloaded to a folder of its own first) and checks it
   against the draft it serves (the same config: layers, vocabulary, sizes; the
   same tensors and shapes; finite values; the tensors it shares with the
   verifier unchanged); it reports the version prepared, or refused with why.
3. When every rank has it prepared, the scheduler side tells them to *swap*:
   each loads the tensors into its draft model before that step's forward pass
   (vLLM's in-place layerwise reload), so no step drafts with part old and part
   new weights, and requests in flight go on.
4. The workers report the version they serve; the scheduler side names it in
   every response and sample from the next step on (a request that finishes in
   the step of the swap verified the old draft's tokens, and names it).

A refused version is reported (:class:`~hsx.schemas.reports.DraftSwapReport`)
and never prepared again; the server keeps its draft.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from pydantic import ValidationError
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorWorkerMetadata

from hsx.dataset.draft_store import DraftStore, local_copy
from hsx.runtime.draft_files import DraftRefused, checked_tensors, read_config, tensor_shapes
from hsx.schemas.drafts import PromotedDraft
from hsx.schemas.reports import DraftSwapReport

log = logging.getLogger(__name__)

POLL_SECONDS = 1.0
REMOTE_POLL_SECONDS = 5.0
"""An object store's pointer is a request each time: every server polls it."""


@dataclass
class DraftWorkerMeta(KVConnectorWorkerMetadata):
    """What the workers say each step: the version they serve, the one they have
    prepared, the versions they refused and why. Ranks agree on a version only
    when each says it."""

    serving: int
    prepared: int | None = None
    refused: dict[int, str] = field(default_factory=dict)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        assert isinstance(other, DraftWorkerMeta)
        return DraftWorkerMeta(serving=min(self.serving, other.serving),
                               prepared=self.prepared if self.prepared == other.prepared else None,
                               refused={**self.refused, **other.refused})


# ==== scheduler side ===================================================================


class SwapPlan:
    """The scheduler side: which version is served, which is wanted, and what the
    workers are told this step."""

    def __init__(self, drafts: str | None, report: Callable[[DraftSwapReport], None]) -> None:
        self._store = DraftStore(drafts) if drafts else None
        self._every = REMOTE_POLL_SECONDS if self._store is not None and self._store.remote else POLL_SECONDS
        self._report = report
        self.serving = 0
        self._wanted: PromotedDraft | None = None
        self._prepare_sent = False
        self._swap_due = False
        self._swap_sent = False
        self._refused: set[int] = set()
        self._seen: bytes | None = None
        """The pointer as last read."""
        self._next_poll = 0.0

    def step(self) -> tuple[PromotedDraft | None, int | None]:
        """This step's orders: a draft to prepare, a version to swap to."""
        self._poll()
        prepare = swap = None
        if self._wanted is not None and not self._prepare_sent:
            prepare, self._prepare_sent = self._wanted, True
        if self._wanted is not None and self._swap_due and not self._swap_sent:
            swap, self._swap_sent = self._wanted.version, True
        return prepare, swap

    def worker_said(self, meta: DraftWorkerMeta) -> None:
        """3-4: a refusal ends the attempt; a version every rank prepared is swapped
        in next step; a version every rank serves is the server's."""
        wanted = self._wanted
        if wanted is None:
            return
        if wanted.version in meta.refused:
            self._refused.add(wanted.version)
            self._wanted = None
            log.error("draft %d (%s) refused: %s; serving draft %d", wanted.version, wanted.path,
                      meta.refused[wanted.version], self.serving)
            self._report(DraftSwapReport(version=wanted.version, path=wanted.path, outcome="refused",
                                         reason=meta.refused[wanted.version]))
        elif meta.serving == wanted.version:
            self.serving, self._wanted = wanted.version, None
            log.info("serving draft %d (%s)", wanted.version, wanted.path)
            self._report(DraftSwapReport(version=wanted.version, path=wanted.path, outcome="swapped"))
        elif meta.prepared == wanted.version:
            self._swap_due = True

    def _poll(self) -> None:
        """1. The pointer, taken up when it changed."""
        now = time.monotonic()
        if self._store is None or now < self._next_poll:
            return
        self._next_poll = now + self._every
        try:
            pointer = self._store.pointer()
        except Exception as exc:  # noqa: BLE001 - an unreachable store is retried, never raised into the engine
            log.error("the drafts pointer at %s does not read: %s", self._store.location, exc)
            return
        if pointer is None or pointer == self._seen:
            return
        self._seen = pointer
        try:
            promoted = PromotedDraft.model_validate_json(pointer)
        except ValidationError as exc:
            log.error("%s's pointer does not read as a promoted draft: %s", self._store.location, exc)
            return
        if promoted.version == self.serving or promoted.version in self._refused:
            return
        if self._wanted is not None and self._wanted.version == promoted.version:
            return
        self._wanted = promoted.model_copy(update={"path": self._store.resolve(promoted.path)})
        self._prepare_sent = self._swap_due = self._swap_sent = False
        log.info("draft %d promoted (%s): preparing it", promoted.version, self._wanted.path)


# ==== worker side ======================================================================


@dataclass
class _Prepared:
    version: int
    path: str
    """Where it was promoted (a directory or an ``s3://`` URL)."""
    local: Path
    tensors: dict[str, torch.Tensor]
    """To load: the checkpoint's tensors less those the draft shares with the verifier."""


class DraftSwapper:
    """The worker side, on each rank: prepares checkpoints off the step and
    swaps them in at the start of one."""

    def __init__(self, served: str, runner: Any) -> None:
        self._runner = runner
        self._served_config = read_config(Path(served))
        self._served_shapes = tensor_shapes(Path(served))
        self.serving = 0
        self._serving_path = Path(served)
        """The served draft's local directory."""
        self._downloads = Path(tempfile.gettempdir()) / f"hsx-drafts-{os.getpid()}"
        """Drafts fetched from an object store: the one served and the one prepared."""
        self._ordered: int | None = None
        """The version last ordered prepared: a slower load of an earlier order is dropped."""
        self._prepared: _Prepared | None = None
        self._refused: dict[int, str] = {}
        self._lock = threading.Lock()

    def prepare(self, promoted: PromotedDraft) -> None:
        """2. Load and check ``promoted`` on a thread; a newer order replaces it."""
        with self._lock:
            self._prepared, self._ordered = None, promoted.version
        threading.Thread(target=self._load, args=(promoted,), name=f"hsx-draft-{promoted.version}",
                         daemon=True).start()

    def swap(self, version: int) -> None:
        """3. Before this step's forward pass: the prepared draft's tensors into the model."""
        with self._lock:
            prepared = self._prepared
        if prepared is None or prepared.version != version:
            log.error("told to swap to draft %d, which this rank has not prepared", version)
            return
        started = time.perf_counter()
        try:
            self._reload(prepared.tensors)
        except Exception as exc:  # noqa: BLE001 - the served draft back rather than a broken one
            log.exception("draft %d (%s) did not load into the model; the served draft reloaded", version,
                          prepared.path)
            self._reload(self._checked(self._serving_path))
            with self._lock:
                self._refused[version] = f"does not load into the model: {type(exc).__name__}: {exc}"
                self._prepared = None
            return
        with self._lock:
            before, self.serving, self._serving_path, self._prepared = (self._serving_path, version, prepared.local,
                                                                        None)
        if before.parent == self._downloads and before != prepared.local:
            shutil.rmtree(before, ignore_errors=True)
        log.info("draft %d (%s) swapped in, %.3f s", version, prepared.path, time.perf_counter() - started)

    def _reload(self, tensors: dict[str, torch.Tensor]) -> None:
        """vLLM's in-place layerwise reload of the draft model."""
        from vllm.model_executor.model_loader.reload.layerwise import (
            finalize_layerwise_reload,
            initialize_layerwise_reload,
        )

        model = self._runner.drafter.model
        initialize_layerwise_reload(model)
        model.load_weights(tensors.items())
        finalize_layerwise_reload(model, self._runner.vllm_config.speculative_config.draft_model_config)

    def close(self) -> None:
        """The drafts downloaded from an object store go with the engine."""
        shutil.rmtree(self._downloads, ignore_errors=True)

    def meta(self) -> DraftWorkerMeta:
        with self._lock:
            prepared = self._prepared.version if self._prepared is not None else None
            return DraftWorkerMeta(serving=self.serving, prepared=prepared, refused=dict(self._refused))

    def _load(self, promoted: PromotedDraft) -> None:
        try:
            local = local_copy(promoted.path, self._downloads)
            tensors = self._checked(local)
        except Exception as exc:  # noqa: BLE001 - any reason to refuse is reported, never raised into the engine
            reason = exc.args[0] if isinstance(exc, DraftRefused) else f"does not load: {type(exc).__name__}: {exc}"
            with self._lock:
                self._refused[promoted.version] = reason
            return
        with self._lock:
            if self._ordered == promoted.version:  # else a newer order came meanwhile
                self._prepared = _Prepared(promoted.version, promoted.path, local, tensors)

    def _checked(self, path: Path) -> dict[str, torch.Tensor]:
        """The checkpoint's tensors to load, or :class:`DraftRefused` naming why not."""
        return self._unshared(checked_tensors(path, self._served_config, self._served_shapes))

    def _unshared(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Without the tensors vLLM shares between the draft and the verifier (an
        embedding or lm_head identical at the start): loading those would change
        the verifier. Each must be unchanged, else the checkpoint is refused."""
        draft, target = self._runner.drafter.model, self._runner.get_model()
        target_params = {id(p) for p in target.parameters()}
        shared = {name: p for name, p in draft.named_parameters() if id(p) in target_params}
        kept = {}
        for name, tensor in tensors.items():
            live = shared.get(name if name.startswith("lm_head") else f"model.{name}")
            if live is None:
                kept[name] = tensor
            elif not torch.equal(live.detach()[: tensor.shape[0]].cpu().to(tensor.dtype), tensor):  # vocab padding
                raise DraftRefused(f"{name} differs from the verifier's, which the served draft shares with it; "
                                   "restart the server to serve this draft")
        return kept
