"""The Kubernetes manifests (k8s/) and container images (docker/), checked offline.

Every overlay renders with ``kubectl kustomize``; core resources validate against
Kubernetes' own schemas (kubernetes-validate); custom resources carry their CRDs'
required fields; the manifests agree with the code (HSX_* settings, CLI flags and
defaults, topic names, client limits); checkov finds nothing that is not skipped with
a reason; hadolint passes the Dockerfiles. The linters live in ``.venv-tools``
(``make tools``): checkov's pinned dependencies would clash with vLLM's.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import tomllib
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import yaml

from extractor.options import ExtractorOptions
from hsx.cli import build_parser
from runtime.kafka.config import MAX_MESSAGE_BYTES, consumer_config
from runtime.settings import KafkaSettings, PromptLimitSettings, TopicSettings

ROOT = Path(__file__).resolve().parents[2]
TOOLS = ROOT / ".venv-tools" / "bin"
OVERLAYS = ["dev", "prod"]
KUBERNETES_VERSION = "1.32.0"
MODEL_LOAD_SECONDS = 300
"""Loading a large model into vLLM takes minutes; scaling must not undo that sooner."""


def _tool(name: str) -> str:
    found = shutil.which(name, path=f"{TOOLS}{os.pathsep}{os.environ.get('PATH', '')}")
    if found is None:
        pytest.fail(f"{name} is missing: run `make tools` (installs it into .venv-tools)")
    return found


@cache
def _render(overlay: str) -> str:
    result = subprocess.run(
        [_tool("kubectl"), "kustomize", str(ROOT / "k8s" / "overlays" / overlay)],
        capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 0, result.stderr
    return result.stdout


class Manifests:
    """One rendered overlay, with the lookups the checks below share."""

    def __init__(self, overlay: str) -> None:
        self.overlay = overlay
        self.text = _render(overlay)
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


@pytest.fixture(params=OVERLAYS)
def manifests(request: pytest.FixtureRequest) -> Manifests:
    return Manifests(request.param)


@pytest.fixture
def settings_env(manifests: Manifests, monkeypatch: pytest.MonkeyPatch) -> Manifests:
    """The process environment a pod of this overlay sees (its hsx-config), so the
    settings classes resolve topic names and limits exactly as the services will."""
    for name in list(os.environ):
        if name.startswith("HSX_"):
            monkeypatch.delenv(name)
    for name, value in manifests.config.items():
        monkeypatch.setenv(name, value)
    return manifests


def _parse(container: dict[str, Any]) -> argparse.Namespace:
    """The container's arguments through hsx's own parser: every flag must exist and
    parse, and none may be given twice (the last one would silently win)."""
    args = container["args"]
    flags = [a.split("=", 1)[0] for a in args if a.startswith("--")]
    assert len(flags) == len(set(flags)), f"{container['name']}: a flag given twice in {args}"
    try:
        return build_parser().parse_args(args)
    except SystemExit:
        pytest.fail(f"{container['name']}: hsx rejects {args}")


def _container(manifests: Manifests, deployment: str) -> dict[str, Any]:
    (container,) = manifests.one("Deployment", deployment)["spec"]["template"]["spec"]["containers"]
    return container


def _setting_names() -> set[str]:
    """Every HSX_* variable the settings classes read, from their fields and prefixes."""
    names = set()
    for cls in (KafkaSettings, TopicSettings, PromptLimitSettings):
        prefix = cls.model_config["env_prefix"]
        names |= {f"{prefix}{field}".upper() for field in cls.model_fields}
    return names


# -- rendering and schemas ---------------------------------------------------------------


def test_every_overlay_renders_the_whole_pipeline(manifests: Manifests) -> None:
    kinds = {d["kind"] for d in manifests.docs}
    assert {"Deployment", "PodDisruptionBudget", "ConfigMap", "PersistentVolumeClaim", "ScaledObject",
            "KafkaTopic", "NetworkPolicy", "Service"} <= kinds
    assert {d["metadata"]["name"] for d in manifests.of_kind("Deployment")} == {"hsx-extractor", "hsx-sink"}


def test_core_resources_match_the_kubernetes_schemas(manifests: Manifests, tmp_path: Path) -> None:
    rendered = tmp_path / f"{manifests.overlay}.yaml"
    rendered.write_text(manifests.text)
    # --no-warn: custom resources have no schema there; the next test covers them.
    result = subprocess.run(
        [_tool("kubernetes-validate"), "--kubernetes-version", KUBERNETES_VERSION, "--strict", "--quiet",
         "--no-warn", str(rendered)],
        capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr


# Required fields of the custom resources, from their CRDs (KEDA keda.sh_scaledobjects /
# _triggerauthentications, Strimzi 043-Crd-kafkatopic, prometheus-operator servicemonitors).
CUSTOM_RESOURCES = {
    "ScaledObject": "keda.sh/v1alpha1",
    "TriggerAuthentication": "keda.sh/v1alpha1",
    "KafkaTopic": "kafka.strimzi.io/v1beta2",
    "ServiceMonitor": "monitoring.coreos.com/v1",
}


def _check_scaled_object(spec: dict[str, Any]) -> None:
    assert spec["scaleTargetRef"]["name"]
    assert spec["triggers"]
    for trigger in spec["triggers"]:
        assert trigger["type"] == "kafka"
        # The CRD types trigger metadata as a map of strings: a bare number is rejected.
        assert all(isinstance(v, str) for v in trigger["metadata"].values()), trigger["metadata"]
        if "authenticationRef" in trigger:
            assert trigger["authenticationRef"]["name"]


def _check_trigger_authentication(spec: dict[str, Any]) -> None:
    assert spec["secretTargetRef"]
    for ref in spec["secretTargetRef"]:
        assert ref["parameter"] and ref["name"] and ref["key"]


def _check_kafka_topic(doc: dict[str, Any]) -> None:
    # The Topic Operator only manages topics labelled with their cluster.
    assert doc["metadata"]["labels"]["strimzi.io/cluster"]
    spec = doc["spec"]
    assert isinstance(spec["partitions"], int) and spec["partitions"] >= 1
    assert isinstance(spec["replicas"], int) and 1 <= spec["replicas"] <= 32767
    assert re.fullmatch(r"[A-Za-z0-9._-]{1,249}", spec.get("topicName", doc["metadata"]["name"]))


def _check_service_monitor(spec: dict[str, Any]) -> None:
    assert spec["selector"]
    assert spec["endpoints"]
    assert all(e.get("port") or e.get("targetPort") for e in spec["endpoints"])


def test_custom_resources_carry_their_required_fields(manifests: Manifests) -> None:
    for doc in manifests.docs:
        kind = doc["kind"]
        if kind not in CUSTOM_RESOURCES:
            continue
        assert doc["apiVersion"] == CUSTOM_RESOURCES[kind], doc["metadata"]["name"]
        if kind == "KafkaTopic":
            _check_kafka_topic(doc)
        else:
            {"ScaledObject": _check_scaled_object, "TriggerAuthentication": _check_trigger_authentication,
             "ServiceMonitor": _check_service_monitor}[kind](doc["spec"])


# -- manifests against the code ----------------------------------------------------------


def test_every_hsx_variable_is_a_real_setting(manifests: Manifests) -> None:
    known = _setting_names()
    used = set(manifests.config)
    for _, container in manifests.hsx_containers():
        used |= {e["name"] for e in container.get("env", [])}
    for auth in manifests.of_kind("TriggerAuthentication"):
        used |= {ref["key"] for ref in auth["spec"]["secretTargetRef"]}
    unknown = {name for name in used if name.startswith("HSX_")} - known
    assert not unknown, f"not read by runtime/settings.py: {sorted(unknown)}"


def test_container_arguments_are_real_hsx_commands(manifests: Manifests) -> None:
    commands = {}
    for workload, container in manifests.hsx_containers():
        commands[workload["metadata"]["name"]] = _parse(container).command
    assert commands["hsx-extractor"] == "extract"
    assert commands["hsx-sink"] == "sink"


def test_probes_scrape_and_service_use_the_health_port(manifests: Manifests) -> None:
    for name in ("hsx-extractor", "hsx-sink"):
        deployment = manifests.one("Deployment", name)
        container = _container(manifests, name)
        port = _parse(container).health_port
        assert port is not None, f"{name} serves no /healthz without --health-port"
        named = {p["name"]: p["containerPort"] for p in container["ports"]}
        for probe, path in (("startupProbe", "/healthz"), ("livenessProbe", "/healthz"), ("readinessProbe", "/readyz")):
            get = container[probe]["httpGet"]
            assert get["path"] == path, (name, probe)
            assert named.get(get["port"], get["port"]) == port, (name, probe)
        assert deployment["spec"]["template"]["metadata"]["annotations"]["prometheus.io/port"] == str(port)
        service = manifests.one("Service", f"{name}-metrics")
        assert named[service["spec"]["ports"][0]["targetPort"]] == port


def test_grace_periods_cover_the_drain(manifests: Manifests) -> None:
    extractor = manifests.one("Deployment", "hsx-extractor")["spec"]["template"]["spec"]
    # In-flight prompts (drain_timeout), then the DLQ producer's 30 s flush, then commit.
    assert extractor["terminationGracePeriodSeconds"] > ExtractorOptions().drain_timeout + 30
    sink = manifests.one("Deployment", "hsx-sink")["spec"]["template"]["spec"]
    # Open shards written, ready events flushed (60 s), the producer's final flush (30 s).
    assert sink["terminationGracePeriodSeconds"] > 60 + 30


def test_autoscaling_watches_what_the_services_consume(settings_env: Manifests) -> None:
    manifests = settings_env
    topics = TopicSettings()
    consumed = {"hsx-extractor": topics.prompts, "hsx-sink": topics.blocks}
    for scaled in manifests.of_kind("ScaledObject"):
        target = scaled["spec"]["scaleTargetRef"]["name"]
        args = _parse(_container(manifests, target))
        (trigger,) = scaled["spec"]["triggers"]
        meta = trigger["metadata"]
        assert meta["bootstrapServers"] == (args.bootstrap or KafkaSettings().bootstrap), target
        assert meta["consumerGroup"] == args.group, target
        topic = args.topic or consumed[target]
        assert meta["topic"] == topic, target
        reset = consumer_config(KafkaSettings(), args.group)["auto.offset.reset"]
        assert meta["offsetResetPolicy"] == reset, target
        spec = scaled["spec"]
        partitions = manifests.topic(topic)["spec"]["partitions"]
        assert spec.get("minReplicaCount", 0) <= spec["maxReplicaCount"] <= partitions, target
        assert "activationLagThreshold" in meta and "lagThreshold" in meta


def test_extractor_scale_down_waits_out_a_model_load(manifests: Manifests) -> None:
    spec = manifests.one("ScaledObject", "hsx-extractor")["spec"]
    assert spec["cooldownPeriod"] >= MODEL_LOAD_SECONDS
    scale_down = spec["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]["scaleDown"]
    assert scale_down["stabilizationWindowSeconds"] >= MODEL_LOAD_SECONDS


def test_topics_match_settings_and_record_sizes(settings_env: Manifests) -> None:
    manifests = settings_env
    settings = TopicSettings()
    expected = set(vars(settings.topics()).values())
    assert {t["spec"]["topicName"] for t in manifests.of_kind("KafkaTopic")} == expected
    for name in expected:
        spec = manifests.topic(name)["spec"]
        # A service that finds a topic missing creates it from these settings.
        assert spec["partitions"] == settings.partitions, name
        assert spec["replicas"] == settings.replication_factor, name
        # Nothing the broker accepts may be larger than hsx's clients produce or fetch.
        assert int(spec["config"].get("max.message.bytes", 0)) <= MAX_MESSAGE_BYTES, name
        assert int(spec["config"]["min.insync.replicas"]) <= spec["replicas"], name
    prompts = manifests.topic(settings.prompts)["spec"]["config"]
    assert int(prompts["max.message.bytes"]) > PromptLimitSettings().limits().max_event_bytes
    block_bytes = _parse(_container(manifests, "hsx-extractor")).block_bytes
    for name in (settings.blocks, settings.blocks_dlq):
        assert int(manifests.topic(name)["spec"]["config"]["max.message.bytes"]) >= 2 * block_bytes, name


def test_prod_extractor_gets_a_gpu_and_dev_none() -> None:
    for overlay in OVERLAYS:
        container = _container(Manifests(overlay), "hsx-extractor")
        args = _parse(container)
        gpus = int(container["resources"].get("limits", {}).get("nvidia.com/gpu", 0))
        if overlay == "prod":
            assert gpus == args.tensor_parallel_size * args.data_parallel_size >= 1
            assert "--dtype=bfloat16" in container["args"]
        else:
            assert gpus == 0
            assert "--enforce-eager" in container["args"]


# -- policy and images -------------------------------------------------------------------


def test_checkov_finds_nothing_unjustified(tmp_path: Path) -> None:
    for overlay in OVERLAYS:
        (tmp_path / f"{overlay}.yaml").write_text(_render(overlay))
    result = subprocess.run(
        # --skip-download: offline; open-source checkov has no severities, so every
        # failed check counts, and each accepted one needs a checkov.io/skip annotation.
        [_tool("checkov"), "--directory", str(tmp_path), "--framework", "kubernetes", "--output", "json",
         "--skip-download"],
        capture_output=True, text=True, timeout=300,
    )
    report = json.loads(result.stdout)
    results = report["results"]
    assert report["summary"]["resource_count"] > 0 and not results["parsing_errors"], report["summary"]
    failed = [(c["check_id"], c["resource"]) for c in results["failed_checks"]]
    assert not failed, failed
    for skipped in results["skipped_checks"]:
        reason = (skipped.get("check_result") or {}).get("suppress_comment", "")
        assert len(reason) > 20, f"{skipped['check_id']} on {skipped['resource']} is skipped without a reason"


DOCKERFILES = sorted((ROOT / "docker").glob("*.Dockerfile"))


def test_dockerfiles_pass_hadolint() -> None:
    result = subprocess.run([_tool("hadolint"), *map(str, DOCKERFILES)], capture_output=True, text=True, timeout=60)
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
    # `pip install .` needs the build files and every package setuptools is told to find.
    assert {"pyproject.toml", pyproject["project"]["readme"]} <= copied
    packages = {p.rstrip("*") for p in pyproject["tool"]["setuptools"]["packages"]["find"]["include"]}
    assert packages <= copied, f"{dockerfile.name} misses {sorted(packages - copied)}"


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
