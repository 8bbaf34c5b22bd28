"""Shared by the tests/k8s modules: the tools, and the overlays rendered with ``kubectl kustomize``."""

from __future__ import annotations

import os
import shutil
import subprocess
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
TOOLS = ROOT / ".venv-tools" / "bin"
OVERLAYS = ["dev", "prod"]


def tool(name: str) -> str:
    """The path of a linter or kubectl. They live in ``.venv-tools`` (``make tools``):
    checkov's pinned dependencies would clash with vLLM's."""
    found = shutil.which(name, path=f"{TOOLS}{os.pathsep}{os.environ.get('PATH', '')}")
    if found is None:
        pytest.fail(f"{name} is missing: run `make tools` (installs it into .venv-tools)")
    return found


@cache
def render(overlay: str) -> str:
    result = subprocess.run(
        [tool("kubectl"), "kustomize", str(ROOT / "k8s" / "overlays" / overlay)],
        capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 0, result.stderr
    return result.stdout


class Manifests:
    """One rendered overlay, with the lookups the checks share."""

    def __init__(self, overlay: str) -> None:
        self.overlay = overlay
        self.text = render(overlay)
        self.docs: list[dict[str, Any]] = [d for d in yaml.safe_load_all(self.text) if d]

    def of_kind(self, kind: str) -> list[dict[str, Any]]:
        return [d for d in self.docs if d["kind"] == kind]

    def one(self, kind: str, name: str) -> dict[str, Any]:
        (doc,) = [d for d in self.of_kind(kind) if d["metadata"]["name"] == name]
        return doc

    @property
    def config(self) -> dict[str, str]:
        """The data of the hsx-config ConfigMap (its name carries a hash suffix)."""
        (cm,) = [d for d in self.of_kind("ConfigMap") if d["metadata"]["name"].startswith("hsx-config-")]
        return cm["data"]

    def workloads(self) -> list[dict[str, Any]]:
        return self.of_kind("Deployment") + self.of_kind("Job")

    def hsx_containers(self) -> list[tuple[dict[str, Any], dict[str, Any]]]:
        """(workload, container) for every container that runs the hsx command."""
        return [
            (w, c) for w in self.workloads() for c in w["spec"]["template"]["spec"]["containers"]
            if c.get("command") == ["hsx"]
        ]

    def topic(self, name: str) -> dict[str, Any]:
        (doc,) = [d for d in self.of_kind("KafkaTopic") if d["spec"].get("topicName", d["metadata"]["name"]) == name]
        return doc
