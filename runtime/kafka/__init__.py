"""The thin Kafka layer: client configuration, topic administration, the one
producer wrapper (every record accounted for by its delivery report) and the
one consumer error policy."""

from runtime.kafka.admin import ensure_topics
from runtime.kafka.config import client_config, consumer_config, producer_config
from runtime.kafka.errors import ConsumerErrors, DeliveryFailed, KafkaFatal, KafkaUnavailable
from runtime.kafka.producer import RecordProducer, make_producer

__all__ = [
    "ConsumerErrors",
    "DeliveryFailed",
    "KafkaFatal",
    "KafkaUnavailable",
    "RecordProducer",
    "client_config",
    "consumer_config",
    "ensure_topics",
    "make_producer",
    "producer_config",
]
