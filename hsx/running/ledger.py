"""Accounting for a job's prompts: every published request id ends in a ready
event or a dead letter. ``hsx run`` finishes when the ledger balances."""

from __future__ import annotations

import logging
import uuid
from collections import Counter
from dataclasses import dataclass, field
from typing import Protocol

from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaException, Message, TopicPartition

from hsx.runtime.errors import ServiceFailed
from hsx.runtime.kafka import ConsumerErrors, consumer_config
from hsx.runtime.kafka.config import METADATA_TIMEOUT_S
from hsx.runtime.settings import KafkaSettings
from hsx.schemas import DlqHeaders, ErrorClass, HiddenStatesReady, Topics, sample_id

log = logging.getLogger(__name__)

# A superseded attempt's leftovers are dead-lettered while another attempt of the
# same request completes: they say nothing about the request's outcome.
NOT_TERMINAL = {ErrorClass.SUPERSEDED_ATTEMPT}


class Outcomes(Protocol):
    """What a :class:`LedgerFeed` fills: the outcome of each request id it reads."""

    foreign: int

    def record_ready(self, event: HiddenStatesReady) -> None: ...

    def record_dead_letter(self, request_id: str, error_class: ErrorClass) -> None: ...


@dataclass
class Ledger:
    """Outcomes of published request ids, read from ``hidden_states.ready`` and both DLQs."""

    published: set[str] = field(default_factory=set)
    ready: dict[str, HiddenStatesReady] = field(default_factory=dict)
    dead: dict[str, ErrorClass] = field(default_factory=dict)
    foreign: int = 0
    """Records on these topics that are not what hsx's services write (topics
    shared through ``HSX_TOPIC_*`` can hold anyone's): skipped with a warning; a
    published id they would have accounted for is reported missing."""

    def record_ready(self, event: HiddenStatesReady) -> None:
        self.ready.setdefault(event.request_id, event)

    def record_dead_letter(self, request_id: str, error_class: ErrorClass) -> None:
        if error_class not in NOT_TERMINAL:
            self.dead.setdefault(request_id, error_class)

    @property
    def samples(self) -> set[str]:
        """Published ids with a sample (a ready event wins over an earlier dead letter,
        e.g. an attempt that timed out and was then retried)."""
        return self.published & self.ready.keys()

    @property
    def failed(self) -> dict[str, ErrorClass]:
        return {r: c for r, c in self.dead.items() if r in self.published and r not in self.ready}

    @property
    def accounted(self) -> int:
        return len(self.samples) + len(self.failed)

    @property
    def missing(self) -> set[str]:
        return self.published - self.ready.keys() - self.dead.keys()

    def dead_letters_by_class(self) -> Counter[str]:
        return Counter(c.value for c in self.failed.values())


class LedgerFeed:
    """A throw-away consumer of the ready topic and both dead-letter topics, from
    their beginning, that fills a :class:`Ledger` (or any :class:`Outcomes`).

    It reads every partition itself (``assign``), not as a consumer-group member:
    a group's session expires whenever the broker pauses longer than its timeout
    (``hsx serve`` follows these topics while the broker may be down), and a
    member that rejoins without commits reads its partitions again from the start.
    The topics must exist (their partitions are read once, here)."""

    def __init__(self, consumer: Consumer, topics: Topics, ledger: Outcomes) -> None:
        self.ledger = ledger
        self._topics = topics
        self._consumer = consumer
        self._errors = ConsumerErrors("hsx-run")

    @classmethod
    def connect(cls, kafka: KafkaSettings, topics: Topics, ledger: Outcomes) -> LedgerFeed:
        """A feed reading every partition of the three topics from the start."""
        consumer = Consumer(consumer_config(kafka, f"hsx-run-ledger-{uuid.uuid4().hex}"))
        names = [topics.ready, topics.prompts_dlq, topics.blocks_dlq]
        try:
            metadata = consumer.list_topics(timeout=METADATA_TIMEOUT_S).topics
            consumer.assign([TopicPartition(name, p, OFFSET_BEGINNING) for name in names
                             for p in metadata[name].partitions])
        except (KafkaException, KeyError) as exc:
            consumer.close()
            raise ServiceFailed(f"reading {', '.join(names)} at {kafka.bootstrap}: {exc}") from None
        return cls(consumer, topics, ledger)

    def poll(self, timeout: float) -> None:
        """Read what has arrived within ``timeout`` seconds."""
        for message in self._consumer.consume(num_messages=1000, timeout=timeout):
            error = message.error()
            if error is not None:
                self._errors.check(error)  # raises KafkaFatal; transient ones are counted
                continue
            try:
                account(self.ledger, self._topics, message)
            except ValueError as exc:  # ValidationError, UnicodeDecodeError: a record no hsx service wrote
                self.ledger.foreign += 1
                log.warning("%s[%s]@%s: not a record hsx accounts for, skipped (%s)", message.topic(),
                            message.partition(), message.offset(), str(exc).splitlines()[0])

    def close(self) -> None:
        self._consumer.close()


def account(ledger: Outcomes, topics: Topics, message: Message) -> None:
    """Record what one message of the ready or a dead-letter topic says of its
    request; ``ValueError`` (a ``ValidationError``, a ``UnicodeDecodeError``) for
    a record no hsx service wrote."""
    if message.topic() == topics.ready:
        ledger.record_ready(HiddenStatesReady.model_validate_json(message.value() or b""))
    elif message.key():  # the producer's invalid lines have no request id: counted at publishing
        headers = DlqHeaders.from_kafka(message.headers())
        ledger.record_dead_letter(sample_id(message.key().decode()), headers.error_class)
