"""Served samples kept out of training, to judge drafts on: a fixed share of
sample ids, chosen by hash, so the trainer (which skips them) and the gate
(which scores on them) agree without talking, across restarts and replicas."""

from __future__ import annotations

import hashlib


def held_out(sample_id: str, share: float) -> bool:
    """Whether ``sample_id`` is among the ``share`` (0..1) of ids kept out of training."""
    if share <= 0:
        return False
    digest = hashlib.sha256(sample_id.encode()).digest()
    return int.from_bytes(digest[:8], "big") < share * 2**64
