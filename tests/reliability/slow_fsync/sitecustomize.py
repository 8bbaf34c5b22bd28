"""Loaded by the network-fault test's sink (this folder on its PYTHONPATH): while
the file ``SLOW_FSYNC_FLAG`` names exists, every ``os.fsync`` takes 2 s longer,
as on a slow or overloaded disk."""

import os
import time

_fsync = os.fsync
_FLAG = os.environ.get("SLOW_FSYNC_FLAG", "")


def _slow_fsync(fd: int) -> None:
    if _FLAG and os.path.exists(_FLAG):
        time.sleep(2.0)
    _fsync(fd)


os.fsync = _slow_fsync
