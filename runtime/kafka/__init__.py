"""The thin Kafka layer: client configuration, topic administration, and a
producer wrapper that never loses a delivery error."""

from runtime.kafka.admin import ensure_topics
from runtime.kafka.config import client_config, consumer_config, producer_config
from runtime.kafka.errors import DeliveryFailed, KafkaUnavailable
from runtime.kafka.producer import DeliveryTracker, make_producer

__all__ = [
    "DeliveryFailed",
    "DeliveryTracker",
    "KafkaUnavailable",
    "client_config",
    "consumer_config",
    "ensure_topics",
    "make_producer",
    "producer_config",
]
