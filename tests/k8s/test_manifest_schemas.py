"""The rendered overlays: every one builds, validates against Kubernetes' and the CRDs' schemas, passes checkov."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path
from typing import Any

from tests.k8s.manifests import OVERLAYS, Manifests, render, tool

KUBERNETES_VERSION = "1.32.0"


def test_every_overlay_renders_the_whole_pipeline(manifests: Manifests) -> None:
    kinds = {d["kind"] for d in manifests.docs}
    assert {"Deployment", "PodDisruptionBudget", "ConfigMap", "PersistentVolumeClaim", "ScaledObject",
            "KafkaTopic", "NetworkPolicy", "Service"} <= kinds
    optional = {"hsx-serve", "hsx-trainer"}  # components/serving, components/learning
    assert {d["metadata"]["name"] for d in manifests.of_kind("Deployment")} - optional == {"hsx-extractor", "hsx-sink"}


def test_core_resources_match_the_kubernetes_schemas(manifests: Manifests, tmp_path: Path) -> None:
    rendered = tmp_path / f"{manifests.overlay}.yaml"
    rendered.write_text(manifests.text)
    # --no-warn: custom resources have no schema there; the next test covers them.
    result = subprocess.run(
        [tool("kubernetes-validate"), "--kubernetes-version", KUBERNETES_VERSION, "--strict", "--quiet",
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


def test_checkov_finds_nothing_unjustified(tmp_path: Path) -> None:
    for overlay in OVERLAYS:
        (tmp_path / f"{overlay}.yaml").write_text(render(overlay))
    result = subprocess.run(
        # --skip-download: offline; open-source checkov has no severities, so every
        # failed check counts, and each accepted one needs a checkov.io/skip annotation.
        [tool("checkov"), "--directory", str(tmp_path), "--framework", "kubernetes", "--output", "json",
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
