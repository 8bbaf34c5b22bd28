"""One ``hsx`` namespace: the service directories at the top of the repository
(``schemas/``, ``runtime/``, ...) are installed as ``hsx.schemas``, ``hsx.runtime``
and so on by setuptools' ``package-dir`` (pyproject.toml), and ``import hsx``
stays light (its public names load on first access)."""

from __future__ import annotations

import ast
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

import hsx

ROOT = Path(__file__).resolve().parents[2]
MAPPED = ("schemas", "runtime", "producer", "extractor", "sink", "dataset", "trainer")
"""The top-level directories that install as ``hsx.<name>``."""
NOT_INSTALLED = {"tests", "bench"}


def _setuptools() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]


def _sources() -> list[Path]:
    """Every Python file of the repository's own code (installed or not)."""
    roots = [ROOT / "hsx", *(ROOT / name for name in MAPPED), *(ROOT / name for name in sorted(NOT_INSTALLED))]
    return [path for root in roots for path in sorted(root.rglob("*.py")) if "__pycache__" not in path.parts]


def test_no_import_uses_a_bare_service_package() -> None:
    """``from schemas import X`` would still import from the repository root (pytest
    puts it on sys.path), as a second copy of the module beside ``hsx.schemas``;
    installed, it fails. Every absolute import goes through ``hsx.``."""
    bare = []
    for path in _sources():
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [node.module or ""]
            else:
                continue
            bare += [f"{path.relative_to(ROOT)}:{node.lineno}: {name}"
                     for name in names if name.split(".")[0] in MAPPED]
    assert not bare, "import these as hsx.<package>:\n" + "\n".join(bare)


def test_pyproject_maps_every_package_into_hsx() -> None:
    """``packages`` is an explicit list (find cannot map directories into another
    namespace), so a subpackage missing from it would silently not be installed."""
    config = _setuptools()
    package_dir = config["package-dir"]
    assert package_dir == {"hsx": "hsx", **{f"hsx.{name}": name for name in MAPPED}}
    # No other top-level package hides beside them.
    top_level = {path.parent.name for path in ROOT.glob("*/__init__.py")}
    assert top_level - NOT_INSTALLED == set(package_dir.values())

    on_disk = set()
    for package, directory in package_dir.items():
        for init in (ROOT / directory).rglob("__init__.py"):
            on_disk.add(".".join((package, *init.parent.relative_to(ROOT / directory).parts)))
    assert sorted(config["packages"]) == sorted(on_disk)
    assert "hsx.schemas" in config["package-data"]  # the committed JSON Schemas ship


def test_import_hsx_loads_neither_torch_nor_vllm(tmp_path: Path) -> None:
    """In a fresh interpreter, from a directory where the repository is not on the
    path: ``import hsx`` imports no torch, no vLLM and none of hsx's packages; the
    contracts and the dataset readers come without either."""
    code = (
        "import sys\n"
        "import hsx\n"
        "loaded = sorted(m for m in sys.modules if m.split('.')[0] in {'torch', 'vllm'} or m.startswith('hsx.'))\n"
        "assert not loaded, loaded\n"
        "assert hsx.PromptEvent.__module__ == 'hsx.schemas.prompt'\n"
        "assert 'torch' not in sys.modules and 'vllm' not in sys.modules and 'hsx.sink' not in sys.modules\n"
        "import hsx.dataset.reader\n"
        "assert hsx.open_dataset is hsx.dataset.reader.open_dataset and hsx.follow is hsx.dataset.reader.follow\n"
        "assert 'torch' not in sys.modules and 'vllm' not in sys.modules\n"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


def test_public_api_resolves_to_its_defining_modules() -> None:
    from hsx.dataset.reader import follow, open_dataset
    from hsx.schemas import PromptEvent
    from hsx.trainer import HsxDataset, PackedCollate, ReadyStream

    expected = {"open_dataset": open_dataset, "follow": follow, "HsxDataset": HsxDataset,
                "ReadyStream": ReadyStream, "PackedCollate": PackedCollate, "PromptEvent": PromptEvent}
    assert sorted(hsx.__all__) == sorted(expected)
    assert all(getattr(hsx, name) is value for name, value in expected.items())
    assert set(hsx.__all__) <= set(dir(hsx))
    with pytest.raises(AttributeError, match="no attribute 'nothing_here'"):
        hsx.nothing_here  # noqa: B018
    from hsx import models  # a submodule still imports through the lazy __getattr__

    assert models.__name__ == "hsx.models"


def test_type_checking_imports_match_the_lazy_table() -> None:
    """Type checkers see the TYPE_CHECKING imports, the runtime the lazy table: they
    must name the same modules."""
    tree = ast.parse((ROOT / "hsx" / "__init__.py").read_text())
    (block,) = [node for node in tree.body if isinstance(node, ast.If)
                and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"]
    seen = {alias.name: node.module for node in block.body if isinstance(node, ast.ImportFrom) for alias in node.names}
    assert seen == hsx._LAZY
