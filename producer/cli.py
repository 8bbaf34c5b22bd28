"""``hsx produce FILE|-``: publish a JSONL file of prompts."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO

from tqdm import tqdm

from producer.publisher import InvalidLine, InvalidPolicy, Mapping, Publisher, PublishSummary
from producer.sources import DatasetFormat, read_jsonl
from runtime.errors import ExitCode, UsageError
from runtime.kafka import DeliveryTracker, ensure_topics, make_producer
from runtime.settings import KafkaSettings, PromptLimitSettings, TopicSettings, overrides
from runtime.logs import redact_secrets

log = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("file", help="JSONL file to publish, or - for standard input")
    parser.add_argument("--bootstrap", help="Kafka bootstrap servers (env HSX_KAFKA_BOOTSTRAP)")
    parser.add_argument("--topic", help="prompts topic (env HSX_TOPIC_PROMPTS, default prompts)")
    parser.add_argument("--dlq-topic", help="dead-letter topic (env HSX_TOPIC_PROMPTS_DLQ, default prompts.dlq)")
    parser.add_argument(
        "--format",
        type=DatasetFormat,
        choices=list(DatasetFormat),
        default=DatasetFormat.EVENT,
        help="shape of each line: event (a PromptEvent), text (a text field), "
        "sharegpt (conversations of from/value), openai (messages of role/content)",
    )
    parser.add_argument("--text-field", default="text", help="field holding the prompt for --format text")
    parser.add_argument("--id-field", help="field holding the request id (default: request_id, else generated)")
    parser.add_argument(
        "--metadata-fields", default="", help="comma-separated fields copied into the event's metadata"
    )
    parser.add_argument(
        "--on-invalid",
        type=InvalidPolicy,
        choices=list(InvalidPolicy),
        default=InvalidPolicy.SKIP,
        help="what to do with an invalid line (default: skip, reporting it)",
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


@contextmanager
def _open_input(name: str) -> Iterator[tuple[IO[bytes], str]]:
    if name == "-":
        yield sys.stdin.buffer, "stdin"
        return
    path = Path(name)
    with path.open("rb") as stream:
        yield stream, path.name


def run(args: argparse.Namespace) -> int:
    kafka = KafkaSettings(**overrides(bootstrap=args.bootstrap))
    redact_secrets(kafka.secret_values())
    topic_settings = TopicSettings(**overrides(prompts=args.topic, prompts_dlq=args.dlq_topic))
    topics = topic_settings.topics()
    mapping = Mapping(
        fmt=args.format,
        text_field=args.text_field,
        id_field=args.id_field,
        metadata_fields=tuple(f for f in args.metadata_fields.split(",") if f),
    )
    ensure_topics(kafka, topic_settings, [topics.prompts, topics.prompts_dlq])
    publisher = Publisher(
        DeliveryTracker(make_producer(kafka)), topics, mapping, PromptLimitSettings().limits(), args.on_invalid
    )
    try:
        with _open_input(args.file) as (stream, source), _progress(args.no_progress) as bar:
            summary = publisher.publish(read_jsonl(stream, source), on_line=bar)
    except OSError as exc:
        raise UsageError(f"cannot read {args.file}: {exc.strerror}") from exc
    except InvalidLine as exc:
        log.error("stopped at the first invalid line (--on-invalid fail): %s", exc)
        return ExitCode.FAILED
    print(summary.describe(), file=sys.stderr)
    return 0


@contextmanager
def _progress(disabled: bool) -> Iterator[Callable[[PublishSummary], None]]:
    with tqdm(unit=" events", disable=disabled, file=sys.stderr, mininterval=0.5) as bar:

        def update(summary: PublishSummary) -> None:
            bar.n = summary.sent
            bar.set_postfix(invalid=summary.invalid, refresh=False)
            bar.update(0)

        yield update
