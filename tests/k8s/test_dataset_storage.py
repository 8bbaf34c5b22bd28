"""Where the sinks write the dataset: prod to an s3:// URL from the ConfigMap, with no
dataset volume and its credentials from a Secret; dev to the shared volume it mounts."""

from __future__ import annotations

import re
from pathlib import PurePosixPath
from typing import Any
from urllib.parse import urlsplit

from tests.k8s.manifests import Manifests, references

DATASET_CLAIM = "hsx-dataset"
S3_SECRET = "hsx-s3-credentials"
# What the storage client reads from the environment (the AWS conventions): the
# credentials must come from a Secret (or the credential chain), the rest may be plain
# configuration. A name outside both sets is a typo nothing reads.
SECRET_AWS = {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN"}
PLAIN_AWS = {"AWS_ENDPOINT_URL", "AWS_REGION", "AWS_DEFAULT_REGION", "AWS_ALLOW_HTTP",
             "AWS_ROLE_ARN", "AWS_WEB_IDENTITY_TOKEN_FILE"}
# S3 bucket names: 3-63 characters, lower-case letters, digits, dots and hyphens.
BUCKET = re.compile(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]")


def _sink(manifests: Manifests) -> tuple[dict[str, Any], dict[str, Any]]:
    """(pod spec, container) of the sink Deployment."""
    spec = manifests.one("Deployment", "hsx-sink")["spec"]["template"]["spec"]
    (container,) = spec["containers"]
    return spec, container


def _output(args: list[str]) -> str:
    (output,) = [a.split("=", 1)[1] for a in args if a.startswith("--output=")]
    return output


def _claims_mounted(spec: dict[str, Any], container: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """mountPath -> the mount, for each of the container's mounts backed by a PersistentVolumeClaim."""
    claims = {v["name"]: v["persistentVolumeClaim"]["claimName"]
              for v in spec.get("volumes", []) if "persistentVolumeClaim" in v}
    return {m["mountPath"]: m | {"claimName": claims[m["name"]]}
            for m in container.get("volumeMounts", []) if m["name"] in claims}


def _plain_aws(manifests: Manifests) -> dict[str, str]:
    """AWS_* settings given as values in the manifests: ConfigMaps and env literals."""
    found: dict[str, str] = {}
    for cm in manifests.of_kind("ConfigMap"):
        found |= {k: v for k, v in cm.get("data", {}).items() if k.startswith("AWS_")}
    for workload in manifests.workloads():
        for container in workload["spec"]["template"]["spec"]["containers"]:
            found |= {e["name"]: e.get("value", "") for e in container.get("env", [])
                      if e["name"].startswith("AWS_") and "valueFrom" not in e}
    return found


def test_prod_sink_writes_to_an_s3_url_from_the_config() -> None:
    manifests = Manifests("prod")
    _, container = _sink(manifests)
    written = _output(container["args"])
    # The manifest names a ConfigMap key; the kubelet expands it from envFrom hsx-config.
    (name,) = references(written)
    assert written == f"$({name})", written
    assert name in manifests.config, f"{name} is not in hsx-config"
    url = urlsplit(_output(manifests.args(container)))
    assert url.scheme == "s3", url.geturl()
    assert BUCKET.fullmatch(url.netloc), f"not a bucket name: {url.netloc!r}"
    assert url.path.strip("/"), "the dataset needs a prefix of its own in the bucket"
    assert not url.query and not url.fragment, url.geturl()
    # The bucket's region, and an endpoint only for stores other than AWS.
    assert manifests.config.get("AWS_REGION")


def test_prod_has_no_dataset_volume() -> None:
    manifests = Manifests("prod")
    claims = {d["metadata"]["name"] for d in manifests.of_kind("PersistentVolumeClaim")}
    assert DATASET_CLAIM not in claims
    assert claims == {"models", "hsx-trainer"}, "prod's volumes: the models, and the trainer's checkpoints"
    spec, container = _sink(manifests)
    assert not [v for v in spec.get("volumes", []) if "persistentVolumeClaim" in v or "hostPath" in v], \
        "the sink writes to the bucket only"
    assert "dataset" not in {v["name"] for v in spec.get("volumes", [])}
    assert "/dataset" not in {m["mountPath"] for m in container.get("volumeMounts", [])}
    for workload in manifests.workloads():
        for volume in workload["spec"]["template"]["spec"].get("volumes", []):
            assert volume.get("persistentVolumeClaim", {}).get("claimName") != DATASET_CLAIM, \
                workload["metadata"]["name"]


def test_prod_s3_credentials_come_from_a_secret() -> None:
    manifests = Manifests("prod")
    _, container = _sink(manifests)
    refs = {r["name"]: r for r in manifests.secret_refs(container)}
    assert S3_SECRET in refs, "the sink reads its S3 keys from the Secret"
    assert refs[S3_SECRET].get("optional") is False, "without credentials the sink must not start"
    # Not as literals, anywhere; and the repository ships no Secret (its values would be committed).
    assert not SECRET_AWS & set(manifests.environment(container))
    assert not SECRET_AWS & set(_plain_aws(manifests)), "S3 keys belong in the Secret, not in the manifests"


def test_no_overlay_ships_a_secret(manifests: Manifests) -> None:
    assert not manifests.of_kind("Secret"), "Secrets are created in the cluster (docs/kubernetes.md)"
    assert not [d for d in manifests.docs if d["kind"] == "ConfigMap"
                and SECRET_AWS & set(d.get("data", {}))]


def test_aws_settings_are_ones_the_client_reads(manifests: Manifests) -> None:
    plain = _plain_aws(manifests)
    unknown = set(plain) - PLAIN_AWS - SECRET_AWS
    assert not unknown, f"no AWS client reads {sorted(unknown)}"
    endpoint = plain.get("AWS_ENDPOINT_URL")
    allow_http = plain.get("AWS_ALLOW_HTTP", "false").lower() == "true"
    if endpoint is not None:
        scheme = urlsplit(endpoint).scheme
        assert scheme in ("http", "https"), endpoint
        # Plain http is refused unless allowed; allowing it for an https endpoint is a slip.
        assert (scheme == "http") == allow_http, (endpoint, plain.get("AWS_ALLOW_HTTP"))
    else:
        assert not allow_http, "AWS_ALLOW_HTTP without an endpoint: AWS itself is https"


def test_dev_sink_writes_to_the_shared_volume() -> None:
    manifests = Manifests("dev")
    spec, container = _sink(manifests)
    output = PurePosixPath(_output(manifests.args(container)))
    assert output.is_absolute(), output
    mounts = _claims_mounted(spec, container)
    (mount,) = [m for path, m in mounts.items() if output.is_relative_to(path)]
    assert mount["claimName"] == DATASET_CLAIM
    assert not mount.get("readOnly"), "the sink writes the dataset"
    assert DATASET_CLAIM in {d["metadata"]["name"] for d in manifests.of_kind("PersistentVolumeClaim")}
    assert S3_SECRET not in {r["name"] for r in manifests.secret_refs(container)}


def test_sink_output_is_a_bucket_or_a_mounted_claim(manifests: Manifests) -> None:
    """Either way the sink writes where its replicas share the dataset: a bucket prefix,
    or a PersistentVolumeClaim (never the container's own filesystem, an emptyDir)."""
    spec, container = _sink(manifests)
    output = _output(manifests.args(container))
    assert "$(" not in output, f"{output} did not expand"
    if output.startswith("s3://"):
        assert not _claims_mounted(spec, container), "a sink writing to a bucket mounts no claim"
        assert S3_SECRET in {r["name"] for r in manifests.secret_refs(container)}
    else:
        assert any(PurePosixPath(output).is_relative_to(path) for path in _claims_mounted(spec, container)), output
