"""A bounded memory of recently seen keys: consumers of ``hidden_states.ready``
skip events they have already seen (a sink re-announces a stored sample after a
replay) without holding every event id of a dataset of millions."""

from __future__ import annotations

from collections import OrderedDict


class RecentKeys:
    """The last ``limit`` distinct keys added, oldest forgotten first."""

    def __init__(self, limit: int) -> None:
        if limit < 0:
            raise ValueError(f"limit {limit}: must be >= 0")
        self._limit = limit
        self._keys: OrderedDict[str, None] = OrderedDict()

    def add(self, key: str) -> bool:
        """Remember ``key``; False when it was already among the recent ones."""
        if key in self._keys:
            return False
        self._keys[key] = None
        if len(self._keys) > self._limit:
            self._keys.popitem(last=False)
        return True

    def __len__(self) -> int:
        return len(self._keys)
