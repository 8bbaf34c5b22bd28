"""The manifests agree with the code: HSX_* settings, CLI flags and defaults, topic names, client limits."""

from __future__ import annotations

import argparse
import os
from typing import Any

import pytest

from hsx.cli import build_parser
from hsx.extractor.options import ExtractorOptions
from hsx.runtime.kafka.config import MAX_MESSAGE_BYTES, consumer_config
from hsx.runtime.settings import KafkaSettings, PromptLimitSettings, TopicSettings
from hsx.schemas.connector import INLINE_BLOCK_BYTES
from tests.k8s.manifests import OVERLAYS, Manifests, references

MODEL_LOAD_SECONDS = 300
"""Loading a large model into vLLM takes minutes; scaling must not undo that sooner."""


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


def _parse(manifests: Manifests, container: dict[str, Any]) -> argparse.Namespace:
    """The container's arguments through hsx's own parser, as the process receives them
    ($(NAME) expanded from its environment): every flag must exist and parse, and none
    may be given twice (the last one would silently win)."""
    args = manifests.args(container)
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


def test_every_hsx_variable_is_a_real_setting(manifests: Manifests) -> None:
    known = _setting_names()
    used = set(manifests.config)
    # A name the arguments refer to, $(HSX_DATASET_URL), is read by Kubernetes, not hsx
    # (the next test checks that it resolves).
    expanded = set()
    for _, container in manifests.hsx_containers():
        used |= {e["name"] for e in container.get("env", [])}
        expanded |= {name for arg in container.get("command", []) + container.get("args", [])
                     for name in references(arg)}
    known |= expanded
    for auth in manifests.of_kind("TriggerAuthentication"):
        used |= {ref["key"] for ref in auth["spec"]["secretTargetRef"]}
    unknown = {name for name in used if name.startswith("HSX_")} - known
    assert not unknown, f"not read by runtime/settings.py: {sorted(unknown)}"


def test_argument_references_resolve_from_the_config(manifests: Manifests) -> None:
    """Kubernetes leaves an unknown $(NAME) as written (the sink would write to a folder
    named so), and one from a Secret would put the secret in the pod's command line."""
    for workload, container in manifests.hsx_containers():
        env = manifests.environment(container)
        for arg in container.get("command", []) + container.get("args", []):
            for name in references(arg):
                assert env.get(name), f"{workload['metadata']['name']}: {arg} names no ConfigMap or env value"


def test_container_arguments_are_real_hsx_commands(manifests: Manifests) -> None:
    commands = {}
    for workload, container in manifests.hsx_containers():
        commands[workload["metadata"]["name"]] = _parse(manifests, container).command
    assert commands["hsx-extractor"] == "extract"
    assert commands["hsx-sink"] == "sink"
    assert commands.get("hsx-serve", "serve") == "serve"  # components/serving, where an overlay includes it


def test_probes_scrape_and_service_use_the_health_port(manifests: Manifests) -> None:
    served = [d["metadata"]["name"] for d in manifests.of_kind("Deployment") if d["metadata"]["name"] == "hsx-serve"]
    for name in ("hsx-extractor", "hsx-sink", *served):
        deployment = manifests.one("Deployment", name)
        container = _container(manifests, name)
        port = _parse(manifests, container).health_port
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
        args = _parse(manifests, _container(manifests, target))
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
    # Inline, every block is a record (by reference only manifests are, but an overlay may send inline).
    block_bytes = _parse(manifests, _container(manifests, "hsx-extractor")).block_bytes or INLINE_BLOCK_BYTES
    for name in (settings.blocks, settings.blocks_dlq):
        assert int(manifests.topic(name)["spec"]["config"]["max.message.bytes"]) >= 2 * block_bytes, name


def test_prod_extractor_gets_a_gpu_and_dev_none() -> None:
    for overlay in OVERLAYS:
        manifests = Manifests(overlay)
        container = _container(manifests, "hsx-extractor")
        args = _parse(manifests, container)
        gpus = int(container["resources"].get("limits", {}).get("nvidia.com/gpu", 0))
        if overlay == "prod":
            assert gpus == args.tensor_parallel_size * args.data_parallel_size >= 1
            assert "--dtype=bfloat16" in container["args"]
        else:
            assert gpus == 0
            assert "--enforce-eager" in container["args"]


def test_the_serving_component_sends_to_the_cluster_sinks(manifests: Manifests) -> None:
    served = [d for d in manifests.of_kind("Deployment") if d["metadata"]["name"] == "hsx-serve"]
    assert served or manifests.overlay != "dev", "the dev overlay includes components/serving"
    for deployment in served:
        container = _container(manifests, "hsx-serve")
        args = _parse(manifests, container)
        assert args.command == "serve" and args.no_sink and args.output is None and args.host == "0.0.0.0"
        named = {p["name"]: p["containerPort"] for p in container["ports"]}
        assert named["http"] == args.port
        api = manifests.one("Service", "hsx-serve")["spec"]["ports"][0]
        assert named[api["targetPort"]] == args.port
        # vLLM's drain, then the captures' last acknowledgements.
        assert deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] > args.shutdown_timeout + 60


def test_the_trainer_promotes_where_the_servers_follow(manifests: Manifests) -> None:
    """components/learning: one trainer (the drafts store has one writer) training the
    draft the servers start with, for their verifier, on the dataset their samples join,
    promoting to the store they follow."""
    trainers = [d for d in manifests.of_kind("Deployment") if d["metadata"]["name"] == "hsx-trainer"]
    assert trainers or manifests.overlay != "prod", "the prod overlay includes components/learning"
    for trainer in trainers:
        assert trainer["spec"]["replicas"] == 1 and trainer["spec"]["strategy"]["type"] == "Recreate"
        train = _parse(manifests, _container(manifests, "hsx-trainer"))
        serve = _parse(manifests, _container(manifests, "hsx-serve"))
        sink = _parse(manifests, _container(manifests, "hsx-sink"))
        assert train.command == "train-draft" and train.promote_to.startswith("s3://")
        assert serve.drafts == train.promote_to and serve.draft == str(train.init_from)
        assert serve.model == str(train.model) and train.dataset == sink.output
