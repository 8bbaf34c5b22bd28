"""The thin Kafka layer: client configuration, topic administration, the one
producer wrapper (every record accounted for by its delivery report) and the
one consumer error policy."""

from hsx.runtime.kafka.admin import ensure_topics
from hsx.runtime.kafka.config import client_config, consumer_config, producer_config
from hsx.runtime.kafka.errors import ConsumerErrors, DeliveryFailed, KafkaFatal, KafkaUnavailable
from hsx.runtime.kafka.producer import RecordProducer, make_producer

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
