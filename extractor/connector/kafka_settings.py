"""How the connector gets the extractor's Kafka settings: a JSON file the
extractor writes (mode 0600, in its private temp directory) and whose path it
passes in :class:`~hsx.schemas.connector.ConnectorConfig`.

Not the configuration itself: vLLM logs ``kv_connector_extra_config``, and the
settings hold secrets. Not the environment either: the connector must use exactly
the settings the extractor was given (flags included), whatever its engine
processes inherit.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from pydantic import SecretStr

from hsx.runtime.settings import KafkaSettings

FILE_NAME = "kafka-settings.json"


def write_kafka_settings(settings: KafkaSettings, directory: Path) -> str:
    """Write ``settings``, secrets in clear, to a new file readable only by this
    user in ``directory``; returns its path."""
    path = directory / FILE_NAME
    # Every field, unset ones as null: reading it back must not fill any of them
    # from the reader's HSX_KAFKA_* environment (pydantic-settings would).
    values = {name: value.get_secret_value() if isinstance(value, SecretStr) else value
              for name, value in settings.model_dump().items()}
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(descriptor, "w", encoding="utf-8") as file:
        json.dump(values, file)
    return str(path)


def read_kafka_settings(path: str) -> KafkaSettings:
    """The settings :func:`write_kafka_settings` wrote to ``path``."""
    return KafkaSettings.model_validate_json(Path(path).read_bytes())
