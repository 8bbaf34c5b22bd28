"""``hsx produce INPUT``: publish a file of prompts; and the input flags that
``hsx produce`` and ``hsx run`` share (:func:`add_input_arguments`)."""

from __future__ import annotations

import argparse
import logging
import re
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import NamedTuple

import orjson
from pydantic import ValidationError
from tqdm import tqdm

from hsx.producer.inputs import SHUFFLE_BUFFER, InputKind, InputRows, InputSpec
from hsx.producer.publisher import InvalidLine, InvalidPolicy, Mapping, Publisher, PublishSummary
from hsx.producer.sources import DatasetFormat
from hsx.runtime.checks import enum_value, integer
from hsx.runtime.errors import ExitCode, UsageError
from hsx.runtime.kafka import RecordProducer, ensure_topics
from hsx.runtime.kafka.admin import ONE_SHOT_CONNECT_TIMEOUT, add_connect_timeout
from hsx.runtime.logs import redact_secrets
from hsx.runtime.settings import KafkaSettings, PromptLimitSettings, TopicSettings, overrides
from hsx.schemas import Generation, PromptEvent, format_validation_error

log = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``hsx produce``'s flags: the input flags and where to publish."""
    add_input_arguments(parser)
    parser.add_argument("--bootstrap", help="Kafka bootstrap servers (env HSX_KAFKA_BOOTSTRAP)")
    parser.add_argument("--topic", help="prompts topic (env HSX_TOPIC_PROMPTS, default prompts)")
    parser.add_argument("--dlq-topic", help="dead-letter topic (env HSX_TOPIC_PROMPTS_DLQ, default prompts.dlq)")
    add_connect_timeout(parser, ONE_SHOT_CONNECT_TIMEOUT)
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def add_input_arguments(parser: argparse.ArgumentParser) -> None:
    """The input flags every command that reads prompts shares (``hsx produce``,
    ``hsx run``); :func:`input_from_args` turns them into a :class:`PromptInput`."""
    parser.add_argument(
        "file", metavar="INPUT",
        help="prompts: .jsonl, .json (an array), .parquet, .arrow/.feather, a datasets.save_to_disk "
        "directory, or - for JSONL on standard input",
    )
    parser.add_argument(
        "--input-format", type=enum_value(InputKind), choices=[k.value for k in InputKind],
        help="what INPUT is (default: from its extension, or a directory's dataset_info.json/dataset_dict.json)",
    )
    parser.add_argument(
        "--format",
        type=enum_value(DatasetFormat),
        choices=[f.value for f in DatasetFormat],
        default=DatasetFormat.EVENT,
        help="shape of each row: event (a PromptEvent), text (a text field), "
        "sharegpt (conversations of from/value), openai (messages of role/content)",
    )
    parser.add_argument("--text-field", default="text", help="field holding the prompt for --format text")
    parser.add_argument("--id-field", help="field holding the request id (default: request_id, else generated)")
    parser.add_argument(
        "--metadata-fields", default="", help="comma-separated fields copied into the event's metadata"
    )
    parser.add_argument("--split", help="split of a datasets DatasetDict directory (needed if it has several)")
    parser.add_argument("--limit", type=integer(0), metavar="N", help="publish at most the first N rows (after --shuffle)")
    parser.add_argument(
        "--shuffle", action="store_true",
        help=f"shuffle the rows (within a {SHUFFLE_BUFFER}-row buffer; request ids do not change)",
    )
    parser.add_argument("--seed", type=int, help="shuffle seed (default 0: the same order every time)")
    parser.add_argument(
        "--generate", type=_generation, metavar="KEY=VALUE,...",
        help="let the verifier answer every prompt and capture prompt + answer, e.g. "
        "max_tokens=512,temperature=0.7,seed=1 (hsx.schemas.Generation's fields; a row's own 'generation' wins)",
    )
    parser.add_argument(
        "--chat-template-kwargs", type=_template_kwargs, metavar="JSON",
        help='variables for the model\'s chat template, for every chat, e.g. \'{"enable_thinking": false}\' '
        "(a row's own 'chat_template_kwargs' wins)",
    )
    parser.add_argument("--turns", choices=["all", "last"],
                        help="with --generate, for chats: regenerate every assistant turn, or only the last")
    parser.add_argument(
        "--on-invalid",
        type=enum_value(InvalidPolicy),
        choices=[p.value for p in InvalidPolicy],
        default=InvalidPolicy.SKIP,
        help="what to do with an invalid row (default: skip, reporting it)",
    )


class PromptInput(NamedTuple):
    """The input flags, parsed: the rows (checked already), how they become
    events and what to do with invalid ones (both for :class:`Publisher`)."""

    lines: InputRows
    mapping: Mapping
    on_invalid: InvalidPolicy


def input_from_args(args: argparse.Namespace) -> PromptInput:
    """The :class:`PromptInput` the flags of :func:`add_input_arguments` say.
    Raises :class:`UsageError` for flags that do not go together and for an
    input that cannot be read (nothing is published or started before)."""
    if args.seed is not None and not args.shuffle:
        raise UsageError("--seed only makes sense with --shuffle")
    spec = InputSpec(args.file, args.input_format, args.split, args.limit, args.shuffle, args.seed or 0)
    if args.turns is not None and args.generate is None:
        raise UsageError("--turns only makes sense with --generate")
    generation = args.generate
    if generation is not None and args.turns is not None:
        generation = generation.model_copy(update={"turns": args.turns})
    mapping = Mapping(
        fmt=args.format,
        text_field=args.text_field,
        id_field=args.id_field,
        metadata_fields=tuple(f for f in args.metadata_fields.split(",") if f),
        generation=generation,
        chat_template_kwargs=args.chat_template_kwargs,
    )
    return PromptInput(InputRows(spec), mapping, args.on_invalid)


def _generation(text: str) -> Generation:
    """``max_tokens=512,temperature=0.7,stop_token_ids=[2,7]``: each value is read as
    JSON where it can be (numbers, booleans, lists), else as a string."""
    fields: dict[str, object] = {}
    for item in re.split(r",(?![^\[]*\])", text):  # commas inside [...] belong to a list
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise argparse.ArgumentTypeError(f"wants KEY=VALUE pairs separated by commas, got {item!r}")
        try:
            fields[key.strip()] = orjson.loads(value)
        except orjson.JSONDecodeError:
            fields[key.strip()] = value
    try:
        return Generation.model_validate(fields, strict=False)
    except ValidationError as exc:
        raise argparse.ArgumentTypeError(format_validation_error(exc)) from None


def _template_kwargs(text: str) -> dict[str, object]:
    """A JSON object, checked as a prompt event checks its ``chat_template_kwargs``."""
    try:
        value = orjson.loads(text)
    except orjson.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from None
    try:
        PromptEvent.model_validate({"request_id": "flag", "messages": [{"role": "user", "content": "x"}],
                                    "chat_template_kwargs": value})
    except ValidationError as exc:
        raise argparse.ArgumentTypeError(format_validation_error(exc)) from None
    return value  # type: ignore[no-any-return]


def run(args: argparse.Namespace) -> int:
    kafka = KafkaSettings(**overrides(bootstrap=args.bootstrap))
    redact_secrets(kafka.secret_values())
    topic_settings = TopicSettings(**overrides(prompts=args.topic, prompts_dlq=args.dlq_topic))
    topics = topic_settings.topics()
    prompts = input_from_args(args)  # checks the input before the broker is asked for anything
    ensure_topics(kafka, topic_settings, [topics.prompts, topics.prompts_dlq], timeout=args.connect_timeout)
    publisher = Publisher(RecordProducer.connect(kafka, "producer"), topics, prompts.mapping,
                          PromptLimitSettings().limits(), prompts.on_invalid)
    try:
        with _progress(args.no_progress) as bar:
            summary = publisher.publish(prompts.lines, on_line=bar)
    except OSError as exc:
        raise UsageError(f"cannot read {args.file}: {exc.strerror}") from exc
    except InvalidLine as exc:
        log.error("stopped at the first invalid row (--on-invalid fail): %s", exc)
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
