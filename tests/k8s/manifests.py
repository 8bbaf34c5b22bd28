"""Shared by the tests/k8s modules: the tools, and the overlays rendered with ``kubectl kustomize``."""

from __future__ import annotations

import os
import re
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

# Kubernetes expands $(NAME) in a container's command and args from the container's
# environment (envFrom and env); $$ is a literal $; an unknown name stays as written.
_REFERENCE = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)")


def references(value: str) -> list[str]:
    """The variable names ``value`` refers to as $(NAME) (not the escaped $$(NAME))."""
    return [m.group(1) for m in _REFERENCE.finditer(value) if m.group(1)]


def expand(value: str, environment: dict[str, str | None]) -> str:
    """``value`` as the kubelet hands it to the process: each $(NAME) with a known value
    replaced, $$ made $, anything else left alone."""
    def one(match: re.Match[str]) -> str:
        if match.group(0) == "$$":
            return "$"
        known = environment.get(match.group(1))
        return match.group(0) if known is None else known
    return _REFERENCE.sub(one, value)


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

    def environment(self, container: dict[str, Any]) -> dict[str, str | None]:
        """The variables the container's process sees, in Kubernetes' order (envFrom, then
        env, later ones winning). Values from a Secret or a ``valueFrom`` are not in the
        manifests: None."""
        configmaps = {d["metadata"]["name"]: d.get("data", {}) for d in self.of_kind("ConfigMap")}
        env: dict[str, str | None] = {}
        for source in container.get("envFrom", []):
            prefix = source.get("prefix", "")
            if "configMapRef" in source:
                env |= {prefix + k: v for k, v in configmaps[source["configMapRef"]["name"]].items()}
        for var in container.get("env", []):
            env[var["name"]] = None if "valueFrom" in var else var.get("value", "")
        return env

    def secret_refs(self, container: dict[str, Any]) -> list[dict[str, Any]]:
        """The container's ``envFrom`` Secret references (name, optional)."""
        return [s["secretRef"] for s in container.get("envFrom", []) if "secretRef" in s]

    def args(self, container: dict[str, Any]) -> list[str]:
        """The container's arguments as its process receives them ($(NAME) expanded)."""
        env = self.environment(container)
        return [expand(a, env) for a in container.get("args", [])]

    def topic(self, name: str) -> dict[str, Any]:
        (doc,) = [d for d in self.of_kind("KafkaTopic") if d["spec"].get("topicName", d["metadata"]["name"]) == name]
        return doc
