"""Settings: the HSX_ environment, flags over environment, and Kafka security
options reaching every client without leaking into reprs."""

from __future__ import annotations

import logging

import pytest

from hsx.runtime.kafka import client_config, consumer_config, producer_config
from hsx.runtime.settings import KafkaSettings, PromptLimitSettings, TopicSettings, overrides

SECURE_ENV = {
    "HSX_KAFKA_BOOTSTRAP": "kafka-0.example:9093",
    "HSX_KAFKA_SECURITY_PROTOCOL": "SASL_SSL",
    "HSX_KAFKA_SASL_MECHANISM": "SCRAM-SHA-512",
    "HSX_KAFKA_SASL_USERNAME": "hsx",
    "HSX_KAFKA_SASL_PASSWORD": "pa55-word-secret",
    "HSX_KAFKA_SSL_CA_LOCATION": "/etc/kafka/ca.crt",
    "HSX_KAFKA_SSL_KEY_PASSWORD": "key-secret",
    "HSX_KAFKA_CLIENT_PROPERTIES": '{"socket.keepalive.enable": "true"}',
}
EXPECTED = {
    "bootstrap.servers": "kafka-0.example:9093",
    "security.protocol": "SASL_SSL",
    "sasl.mechanism": "SCRAM-SHA-512",
    "sasl.username": "hsx",
    "sasl.password": "pa55-word-secret",
    "ssl.ca.location": "/etc/kafka/ca.crt",
    "ssl.key.password": "key-secret",
    "socket.keepalive.enable": "true",
}


@pytest.fixture
def secure_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for key, value in SECURE_ENV.items():
        monkeypatch.setenv(key, value)


@pytest.mark.usefixtures("secure_env")
@pytest.mark.parametrize(
    "build",
    [
        lambda s: client_config(s),
        lambda s: producer_config(s),
        lambda s: consumer_config(s, group_id="g"),
    ],
    ids=["admin", "producer", "consumer"],
)
def test_security_options_reach_every_client(build) -> None:  # type: ignore[no-untyped-def]
    config = build(KafkaSettings())
    assert {k: config[k] for k in EXPECTED} == EXPECTED
    assert isinstance(config["logger"], logging.Logger)


@pytest.mark.usefixtures("secure_env")
def test_secrets_never_in_repr_or_dump() -> None:
    settings = KafkaSettings()
    for text in (repr(settings), str(settings), settings.model_dump_json()):
        assert "pa55-word-secret" not in text and "key-secret" not in text
    assert set(settings.secret_values()) == {"pa55-word-secret", "key-secret"}


@pytest.mark.usefixtures("secure_env")
def test_flags_override_environment() -> None:
    settings = KafkaSettings(**overrides(bootstrap="localhost:1234", sasl_username=None))
    assert settings.bootstrap == "localhost:1234"
    assert settings.sasl_username == "hsx"  # a flag not given leaves the env value


def test_invalid_security_protocol_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HSX_KAFKA_SECURITY_PROTOCOL", "SASL_TLS")
    with pytest.raises(ValueError, match="security_protocol"):
        KafkaSettings()


def test_service_defaults_are_safe_for_exactly_once_accounting() -> None:
    producer = producer_config(KafkaSettings())
    assert (producer["enable.idempotence"], producer["acks"]) == (True, "all")
    consumer = consumer_config(KafkaSettings(), group_id="g")
    assert consumer["enable.auto.commit"] is False and consumer["enable.auto.offset.store"] is False
    assert consumer["partition.assignment.strategy"] == "cooperative-sticky"
    assert consumer["isolation.level"] == "read_committed"


def test_topics_and_limits_from_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HSX_TOPIC_PROMPTS", "my-prompts")
    monkeypatch.setenv("HSX_TOPIC_PARTITIONS", "12")
    monkeypatch.setenv("HSX_PROMPT_MAX_TOKEN_IDS", "2048")
    topics = TopicSettings()
    assert (topics.topics().prompts, topics.topics().ready, topics.partitions) == ("my-prompts", "hidden_states.ready", 12)
    assert PromptLimitSettings().limits().max_token_ids == 2048


def test_bad_limit_is_rejected(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HSX_PROMPT_MAX_TOKEN_IDS", "-5")
    with pytest.raises(ValueError, match="max_token_ids"):
        PromptLimitSettings()
