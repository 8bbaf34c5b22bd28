from __future__ import annotations

import pytest

from hsx.runtime.recent import RecentKeys


def test_recent_keys_remember_the_last_limit_distinct_keys() -> None:
    recent = RecentKeys(2)
    assert recent.add("a") and recent.add("b") and not recent.add("a")
    assert recent.add("c")  # forgets "a", the oldest
    assert len(recent) == 2 and recent.add("a") and not recent.add("c")
    with pytest.raises(ValueError, match="must be >= 0"):
        RecentKeys(-1)
