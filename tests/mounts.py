"""A tmpfs mounted for a test (needs root, as on the CI machines): a small file
system to fill, or a read-only one that stops even root from writing."""

from __future__ import annotations

import contextlib
import subprocess
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def tmpfs(path: Path, options: str) -> Iterator[Path]:
    """``path`` (an existing directory) with a tmpfs of ``options`` (``size=64k``,
    ``ro,size=64k``) mounted on it until the block ends."""
    result = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], capture_output=True)
    assert result.returncode == 0, f"this test mounts a tmpfs and needs root: {result.stderr.decode()}"
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)
