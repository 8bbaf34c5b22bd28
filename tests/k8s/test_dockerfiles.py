"""The container images: the Dockerfiles pass hadolint, copy what the package needs and run hsx, not as root."""

from __future__ import annotations

import json
import re
import subprocess
import tomllib
from pathlib import Path

import pytest

from hsx.cli import build_parser
from tests.k8s.manifests import ROOT, tool

DOCKERFILES = sorted((ROOT / "docker").glob("*.Dockerfile"))


def test_dockerfiles_pass_hadolint() -> None:
    result = subprocess.run([tool("hadolint"), *map(str, DOCKERFILES)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def _instructions(dockerfile: Path) -> list[tuple[str, str]]:
    text = re.sub(r"\\\n", " ", dockerfile.read_text())
    lines = [line.strip() for line in text.splitlines() if line.strip() and not line.strip().startswith("#")]
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1]) for line in lines]


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfile_copies_what_the_package_needs(dockerfile: Path) -> None:
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    ignored = {line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()
               if line.strip() and not line.startswith("#")}
    copied = set()
    for op, rest in _instructions(dockerfile):
        if op != "COPY" or rest.startswith("--from"):
            continue
        *sources, _ = rest.split()
        for source in sources:
            assert (ROOT / source).exists(), f"{dockerfile.name}: COPY {source} does not exist"
            assert source not in ignored, f"{dockerfile.name}: COPY {source} is in .dockerignore"
            copied.add(source)
    # `pip install .` needs the build files and every directory package-dir maps into hsx.
    assert {"pyproject.toml", pyproject["project"]["readme"]} <= copied
    directories = set(pyproject["tool"]["setuptools"]["package-dir"].values())
    assert directories <= copied, f"{dockerfile.name} misses {sorted(directories - copied)}"


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfile_entrypoint_is_the_hsx_command(dockerfile: Path) -> None:
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    (entrypoint,) = [json.loads(rest) for op, rest in _instructions(dockerfile) if op == "ENTRYPOINT"]
    assert entrypoint[0] in scripts
    if len(entrypoint) > 1:  # a fixed subcommand, e.g. hsx extract
        subcommands = build_parser()._subparsers._group_actions[0].choices  # noqa: SLF001 - argparse keeps them there
        assert entrypoint[1] in subcommands
    users = [rest for op, rest in _instructions(dockerfile) if op == "USER"]
    assert users and users[-1] not in ("root", "0"), "the image must not run as root"
