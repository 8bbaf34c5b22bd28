"""The built wheel installs one top-level package, ``hsx``: the service directories
(``schemas/``, ``runtime/``, ...) land inside it as ``hsx.schemas`` and so on, and
nothing importable as ``schemas`` is left to clash with other distributions.

Installs the wheel into a fresh venv, so its dependencies come from the package
index (or pip's cache): minutes on a cold cache."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import zipfile
from importlib import metadata
from pathlib import Path

import pytest

from hsx.dataset.storage import open_storage
from hsx.local.datasets import write_tiny_dataset

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
SOURCES = ("pyproject.toml", "README.md", "hsx", "schemas", "runtime", "producer", "extractor", "sink", "dataset", "trainer")
"""What the Dockerfiles copy into their build context: the wheel must build from it alone."""
SERVICE_PACKAGES = ("schemas", "runtime", "producer", "extractor", "sink", "dataset", "trainer")


def _run(argv: list[str], cwd: Path, timeout: float = 900) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=timeout)


def _setuptools_major() -> int:
    try:
        return int(metadata.version("setuptools").split(".")[0])
    except metadata.PackageNotFoundError:
        return 0


def test_wheel_holds_only_hsx_and_installs_without_torch(tmp_path: Path) -> None:
    # Built from a copy: setuptools writes build/ and *.egg-info beside the sources.
    src = tmp_path / "src"
    src.mkdir()
    for name in SOURCES:
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(ROOT / name, src / name)
    wheels = tmp_path / "wheels"
    # Without build isolation where this environment's setuptools is new enough for
    # pyproject.toml (no download); otherwise pip fetches the build requirements.
    isolation = ["--no-build-isolation"] if _setuptools_major() >= 77 else []
    built = _run([sys.executable, "-m", "pip", "wheel", "--no-deps", *isolation, "-w", str(wheels), str(src)], tmp_path)
    assert built.returncode == 0, built.stdout + built.stderr
    (wheel,) = wheels.glob("hsx-*.whl")
    version = re.match(r"hsx-([^-]+)-", wheel.name).group(1)

    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
    assert {name.split("/")[0] for name in names} == {"hsx", f"hsx-{version}.dist-info"}
    for name in SERVICE_PACKAGES:
        assert f"hsx/{name}/__init__.py" in names
    for data in ("hsx/schemas/json/prompt_event.schema.json", "hsx/data/demo_prompts.jsonl",
                 "hsx/models/tiny_corpus.jsonl", "hsx/extractor/connector/__init__.py"):
        assert data in names

    venv = tmp_path / "venv"
    created = _run([sys.executable, "-m", "venv", str(venv)], tmp_path)
    assert created.returncode == 0, created.stderr
    python = str(venv / "bin" / "python")
    installed = _run([python, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", str(wheel)], tmp_path)
    assert installed.returncode == 0, installed.stdout + installed.stderr

    # cwd: an empty directory, not the repository root, whose directories would be importable.
    work = tmp_path / "work"
    work.mkdir()
    bare = _run([python, "-c", "import schemas"], work, timeout=120)
    assert bare.returncode != 0 and "No module named 'schemas'" in bare.stderr
    none_bare = _run([python, "-c", "import importlib.util as u; "
                      f"found = [n for n in {SERVICE_PACKAGES!r} if u.find_spec(n)]; assert not found, found"], work, 120)
    assert none_bare.returncode == 0, none_bare.stderr
    no_torch = _run([python, "-c", "import torch"], work, timeout=120)
    assert no_torch.returncode != 0 and "No module named 'torch'" in no_torch.stderr

    # The contracts (with the JSON Schemas shipped as package data), the producer and
    # the dataset's index (written here, where torch is) come without torch; reading a
    # sample's tensors needs it.
    dataset = tmp_path / "dataset"
    write_tiny_dataset(open_storage(str(dataset), create=True), "blocks", 0, ["a", "b"])
    code = (
        "import sys\n"
        "from importlib import resources\n"
        "import hsx\n"
        "assert hsx.PromptEvent.__module__ == 'hsx.schemas.prompt'\n"
        "import hsx.producer, hsx.runtime.kafka, hsx.schemas.generate\n"
        "assert (resources.files('hsx.schemas') / 'json' / 'prompt_event.schema.json').is_file()\n"
        "assert (resources.files('hsx') / 'data' / 'demo_prompts.jsonl').is_file()\n"
        f"assert hsx.__file__.startswith({str(venv)!r}), hsx.__file__\n"
        f"ds = hsx.open_dataset({str(dataset)!r})\n"
        "assert len(ds) == 2 and sorted(ds.request_ids()) == ['a', 'b'], ds.request_ids()\n"
        "assert 'torch' not in sys.modules and 'vllm' not in sys.modules\n"
    )
    used = _run([python, "-c", code], work, timeout=120)
    assert used.returncode == 0, used.stderr
