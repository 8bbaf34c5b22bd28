"""Fresh topic sets: the pipeline's five topics under names no other run uses
(``{prefix}{default name}-{random suffix}``), so demos, benchmarks and tests on
one broker never read each other's records."""

from __future__ import annotations

import uuid
from dataclasses import asdict

from hsx.runtime.kafka import ensure_topics
from hsx.runtime.settings import KafkaSettings, TopicSettings
from hsx.schemas import Topics


def fresh_topic_settings(prefix: str = "", partitions: int = 2) -> TopicSettings:
    """Unique names for all five topics (nothing is created), e.g.
    ``demo.hidden_states.blocks-1a2b3c4d`` for the prefix ``demo.``."""
    suffix = uuid.uuid4().hex[:8]
    names = {topic: f"{prefix}{default}-{suffix}" for topic, default in asdict(Topics()).items()}
    return TopicSettings(**names, partitions=partitions)


def fresh_topics(kafka: KafkaSettings, partitions: int = 2, prefix: str = "") -> TopicSettings:
    """A fresh topic set with all five topics created on the broker."""
    settings = fresh_topic_settings(prefix, partitions)
    ensure_topics(kafka, settings, list(asdict(settings.topics()).values()))
    return settings
