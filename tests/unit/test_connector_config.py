"""The extractor → connector contract: the in-flight budget must hold one
request of ``max_model_len`` tokens, and the Kafka settings reach the connector
through a private file, secrets included, never through the config vLLM logs."""

from __future__ import annotations

import json
import stat
from pathlib import Path

import pytest
from pydantic import ValidationError

from hsx.extractor.connector.kafka_settings import read_kafka_settings, write_kafka_settings
from hsx.runtime.settings import KafkaSettings
from hsx.schemas import format_validation_error
from hsx.schemas.connector import INLINE_BLOCK_BYTES, STAGED_BLOCK_BYTES, ConnectorConfig, request_bytes_bound

SECRETS = ("sasl-s3cret", "key-s3cret", "oauth-s3cret")


def _config(**fields: object) -> ConnectorConfig:
    return ConnectorConfig(**{"completion_address": "ipc:///c.sock", "kafka_settings_file": "/k.json",
                              "blocks_topic": "t", "model": "m", **fields})  # type: ignore[arg-type]


def test_a_budget_below_one_request_is_refused_in_one_line() -> None:
    largest = request_bytes_bound(max_model_len=4096, num_layers=4, hidden_size=4096)
    assert largest == 4096 * 4 * 4096 * 4
    assert _config(max_inflight_bytes=largest, max_request_bytes=largest).max_inflight_bytes == largest
    with pytest.raises(ValidationError) as caught:
        _config(max_inflight_bytes=64 << 20, max_request_bytes=largest)
    message = format_validation_error(caught.value)
    assert "\n" not in message
    assert f"max_inflight_bytes {64 << 20} cannot hold one request of max_model_len tokens ({largest} raw bytes)" \
        in message


def test_blocks_are_sized_by_transport_unless_asked() -> None:
    inline = _config(max_request_bytes=1 << 20)
    staged = _config(max_request_bytes=1 << 20, payload_store="s3://bucket/staging")
    assert (inline.block_bytes, inline.target_block_bytes) == (None, INLINE_BLOCK_BYTES)
    assert staged.target_block_bytes == STAGED_BLOCK_BYTES > INLINE_BLOCK_BYTES
    assert _config(max_request_bytes=1 << 20, payload_store="/staging", block_bytes=65536).target_block_bytes == 65536
    with pytest.raises(ValidationError, match="greater than or equal to 4096"):
        _config(max_request_bytes=1 << 20, block_bytes=100)


def test_the_extractor_must_say_where_reports_and_settings_are() -> None:
    with pytest.raises(ValidationError, match="need its completion_address and kafka_settings_file"):
        ConnectorConfig(requests="extractor", kafka_settings_file="/k.json")
    served = ConnectorConfig(bootstrap="kafka:9092")  # vLLM's server: the rest from the engine's own config
    assert served.requests == "served" and served.max_request_bytes is None and served.model is None


def test_the_extractors_engine_always_sends_extractor_requests() -> None:
    """A config built without ``requests`` (a bench, a library user) must not turn
    the extractor's engine into a server that ignores its RequestParams."""
    from hsx.extractor.engine import EngineOptions, engine_args

    args = engine_args(EngineOptions(model="m", layer_ids=[1, 2]), _config(max_request_bytes=1 << 20))
    assert _config().requests == "served"  # the default, for vLLM's own server
    assert args.kv_transfer_config["kv_connector_extra_config"]["hsx"]["requests"] == "extractor"


def test_the_kafka_settings_file_carries_secrets_and_the_logged_config_does_not(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    settings = KafkaSettings(
        bootstrap="kafka-0.example:9093", security_protocol="SASL_SSL", sasl_mechanism="PLAIN",
        sasl_username="hsx", sasl_password=SECRETS[0], ssl_key_password=SECRETS[1],
        client_properties={"sasl.oauthbearer.client.secret": SECRETS[2], "linger.ms": "20"},
    )
    # What the engine processes inherit must not leak into what the connector reads.
    monkeypatch.setenv("HSX_KAFKA_BOOTSTRAP", "elsewhere:9092")
    monkeypatch.setenv("HSX_KAFKA_SASL_PASSWORD", "from-the-environment")
    monkeypatch.setenv("HSX_KAFKA_SSL_CA_LOCATION", "/from/the/environment.pem")

    path = write_kafka_settings(settings, tmp_path)
    assert stat.S_IMODE(Path(path).stat().st_mode) == 0o600
    read = read_kafka_settings(path)
    assert read.client_config() == settings.client_config()
    assert read.secret_values() == list(SECRETS)
    assert read.ssl_ca_location is None

    logged = json.dumps(_config(kafka_settings_file=path, max_request_bytes=1 << 20).model_dump(mode="json"))
    assert path in logged
    assert not [secret for secret in SECRETS if secret in logged]
