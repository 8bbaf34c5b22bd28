"""The rooms of docs/architecture.md import one way: each only the rooms below it.
The trainer reads datasets through ``hsx.dataset``, never through the sink."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ALLOWED = {
    "schemas": {"schemas"},
    "codecs": {"codecs", "schemas"},
    "runtime": {"runtime", "schemas"},
    "dataset": {"dataset", "codecs", "runtime", "schemas"},
    "producer": {"producer", "runtime", "schemas"},
    "extractor": {"extractor", "dataset", "codecs", "runtime", "schemas"},  # dataset.storage: the payload store
    "sink": {"sink", "dataset", "codecs", "runtime", "schemas"},
    "trainer": {"trainer", "dataset", "codecs", "runtime", "schemas"},
}
"""What each room may import (the ``hsx`` package itself, the commands, may import any)."""
DIRECTORY = {"codecs": Path("hsx", "codecs")}
"""Where a room lives when not in a top-level directory of its name."""


def _room(module: str) -> str | None:
    """The room of an absolute import: ``hsx.dataset.reader`` -> ``dataset``,
    ``hsx.local.spawn`` -> ``hsx``; ``None`` for anything outside hsx."""
    parts = module.split(".")
    if parts[0] in ("tests", "bench"):
        return parts[0]
    if parts[0] != "hsx":
        return None
    return parts[1] if len(parts) > 1 and parts[1] in ALLOWED else "hsx"


def _imports(path: Path) -> list[str]:
    names: list[str] = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.append(node.module)
    return names


@pytest.mark.parametrize("room", sorted(ALLOWED))
def test_each_room_imports_only_the_rooms_below_it(room: str) -> None:
    wrong = [f"{path.relative_to(ROOT)} imports {name}"
             for path in sorted((ROOT / DIRECTORY.get(room, Path(room))).rglob("*.py"))
             for name in _imports(path)
             if (found := _room(name)) is not None and found not in ALLOWED[room]]
    assert not wrong, "\n".join(wrong)
