"""Settings read from the environment (prefix ``HSX_``); command-line flags are
passed as constructor arguments, which take precedence over the environment."""

from __future__ import annotations

import argparse
from dataclasses import fields
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, Field, SecretStr, create_model
from pydantic_settings import BaseSettings, SettingsConfigDict

from hsx.schemas import PromptLimits, Topics

T = TypeVar("T")


class KafkaSettings(BaseSettings):
    """Connection and security settings applied to every Kafka client hsx creates.

    ``HSX_KAFKA_BOOTSTRAP``, ``HSX_KAFKA_SECURITY_PROTOCOL``, ``HSX_KAFKA_SASL_*``,
    ``HSX_KAFKA_SSL_*``; any other librdkafka property can be given as JSON in
    ``HSX_KAFKA_CLIENT_PROPERTIES``. Secrets are ``SecretStr`` so they never show in
    a repr, a log line or a dead letter.
    """

    model_config = SettingsConfigDict(env_prefix="HSX_KAFKA_", extra="ignore")

    bootstrap: str = "localhost:9092"
    security_protocol: Literal["PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"] | None = None
    sasl_mechanism: str | None = None
    sasl_username: str | None = None
    sasl_password: SecretStr | None = None
    ssl_ca_location: str | None = None
    ssl_certificate_location: str | None = None
    ssl_key_location: str | None = None
    ssl_key_password: SecretStr | None = None
    ssl_endpoint_identification_algorithm: str | None = None
    client_properties: dict[str, str] = Field(default_factory=dict)

    def client_config(self) -> dict[str, Any]:
        """librdkafka properties common to producers, consumers and admin clients."""
        config: dict[str, Any] = {"bootstrap.servers": self.bootstrap}
        for name in (
            "security_protocol",
            "sasl_mechanism",
            "sasl_username",
            "sasl_password",
            "ssl_ca_location",
            "ssl_certificate_location",
            "ssl_key_location",
            "ssl_key_password",
            "ssl_endpoint_identification_algorithm",
        ):
            value = getattr(self, name)
            if value is None:
                continue
            if isinstance(value, SecretStr):
                value = value.get_secret_value()
            # sasl_username → sasl.username, ssl_ca_location → ssl.ca.location
            config[name.replace("_", ".")] = value
        config.update(self.client_properties)
        return config

    def secret_values(self) -> list[str]:
        """Every secret in these settings, for scrubbing text that leaves the process."""
        secrets = [s.get_secret_value() for s in (self.sasl_password, self.ssl_key_password) if s]
        secrets += [v for k, v in self.client_properties.items() if "password" in k or "secret" in k]
        return [s for s in secrets if s]


class _TopicSettingsBase(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="HSX_TOPIC_", extra="ignore")

    partitions: int = Field(default=4, ge=1)
    replication_factor: int = Field(default=1, ge=1)

    def topics(self) -> Topics:
        """The topic names these settings name."""
        return Topics(**{f.name: getattr(self, f.name) for f in fields(Topics)})


# Fields: partitions, replication_factor (above) and one name per field of the
# dataclass hsx.schemas.topics.Topics (prompts, blocks, ready, ...; env HSX_TOPIC_PROMPTS,
# ...), derived from it so the contract stays the single list of topics and defaults.
TopicSettings = create_model(  # type: ignore[call-overload]
    "TopicSettings",
    __base__=_TopicSettingsBase,
    __doc__="Topic names (``HSX_TOPIC_PROMPTS``, ...) and how missing topics are created.",
    **{f.name: (str, f.default) for f in fields(Topics)},
)


class _LimitSettingsBase(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="HSX_PROMPT_", extra="ignore")

    def limits(self) -> PromptLimits:
        return PromptLimits(**self.model_dump())


# Fields: one per field of the dataclass hsx.schemas.limits.PromptLimits (max_token_ids,
# ...; env HSX_PROMPT_MAX_TOKEN_IDS, ...), derived from it so the contract stays the
# single definition of the bounds.
PromptLimitSettings = create_model(  # type: ignore[call-overload]
    "PromptLimitSettings",
    __base__=_LimitSettingsBase,
    **{f.name: (int, Field(default=f.default, gt=0)) for f in fields(PromptLimits)},
)


def overrides(**flags: Any) -> dict[str, Any]:
    """Command-line values that were actually given (not ``None``), ready to be
    passed to a settings constructor so that flags win over the environment."""
    return {k: v for k, v in flags.items() if v is not None}


def from_args(cls: type[T], args: argparse.Namespace, **values: Any) -> T:
    """``cls`` (a dataclass or pydantic model) built from the command-line values
    whose flags are named like its fields, then ``values``: the flags' defaults
    come from ``cls``, so each default is written once."""
    names = cls.model_fields if issubclass(cls, BaseModel) else {f.name for f in fields(cls)}  # type: ignore[arg-type]
    picked = {name: getattr(args, name) for name in names if hasattr(args, name)}
    return cls(**{**picked, **values})
