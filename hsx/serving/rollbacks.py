"""A server following a drafts store (``hsx serve --draft D --drafts STORE``,
``--learn`` included) rolls back a promoted draft that serves worse than the
draft before it: its live acceptance (its latest requests, vLLM's own counts:
:mod:`hsx.serving.acceptance`) below the earlier draft's by more than the noise.
The earlier draft is promoted again, as a new version, and every server
following the store takes it up.

1. Each newly served draft is judged once, when it and the draft before it
   have a full window of live acceptance.
2. Not worse beyond the noise: it stays.
3. Worse: unless the store's pointer already names another version (a server
   beside this one rolled back first, or the gate promoted a newer draft), the
   earlier draft's path is published as the next version, with the reason. A
   store that does not answer is asked again at the next check.

Servers behind one store may judge the same draft at once: each publishes only
while the pointer names the draft it judged, so a rollback is published once
(two servers in the same instant publish the same version and path).
"""

from __future__ import annotations

import logging

from prometheus_client import Counter

from hsx.dataset.draft_store import DraftStore
from hsx.schemas.drafts import PromotedDraft
from hsx.schemas.reports import DraftSwapReport
from hsx.serving.acceptance import LiveAcceptance, regressed

log = logging.getLogger(__name__)

ROLLBACKS = Counter("hsx_serve_draft_rollbacks", "Promoted drafts rolled back: their live acceptance fell below the "
                    "draft before them by more than the noise")


class Rollbacks:
    """Each newly served draft judged once, on its first full window."""

    def __init__(self, store: DraftStore, initial: str) -> None:
        self._store = store
        self._initial = initial
        self._judged: set[int] = set()
        self.count = 0

    def check(self, reports: list[DraftSwapReport], live: LiveAcceptance) -> None:
        served = [(0, self._initial)] + [(r.version, r.path) for r in reports if r.outcome == "swapped"]
        if len(served) < 2 or served[-1][0] in self._judged:
            return
        (before_version, before_path), (version, _) = served[-2], served[-1]
        before, after = live.window(before_version), live.window(version)
        if before is None or after is None:
            return
        if not regressed(before, after):
            self._judged.add(version)
            return
        reason = (f"rollback of {version}: live acceptance length {after.acceptance_length:.3f} ± {after.error:.3f} "
                  f"over {after.requests} requests, draft {before_version} had {before.acceptance_length:.3f} ± "
                  f"{before.error:.3f}")
        try:
            pointer = self._store.promoted()
            if pointer is not None and pointer.version != version:  # another server rolled back, or the gate moved on
                log.info("%s; the store names version %d now: no rollback from here", reason, pointer.version)
                self._judged.add(version)
                return
            again = version + 1
            self._store.publish(PromotedDraft(version=again, path=before_path, reason=reason))
        except OSError as exc:  # the store unreachable: judged again at the next check
            log.error("%s, but the drafts store did not answer (%s); trying again", reason, exc)
            return
        self._judged.add(version)
        self.count += 1
        ROLLBACKS.inc()
        log.warning("%s: draft %s promoted again as version %d", reason, before_path, again)
