"""``hsx extract``: run an extractor (consumer-group member driving vLLM)."""

from __future__ import annotations

import argparse
import asyncio
import json
from pathlib import Path

import orjson

from extractor.engine import EngineOptions, default_layer_ids, text_config
from extractor.options import ExtractorOptions
from extractor.service import Extractor
from runtime.errors import UsageError
from runtime.settings import KafkaSettings, PromptLimitSettings, TopicSettings, from_args, overrides
from runtime.logs import redact_secrets
from schemas import Codec
from schemas.connector import ConnectorConfig

_CONNECTOR = {name: field.default for name, field in ConnectorConfig.model_fields.items()}
_SERVICE = ExtractorOptions()
_ENGINE = EngineOptions(model="", layer_ids=[])


def _layer_list(text: str) -> list[int]:
    try:
        layers = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--layers wants comma-separated integers, got {text!r}") from None
    if not layers or len(set(layers)) != len(layers) or min(layers) < 0:
        raise argparse.ArgumentTypeError(f"--layers wants distinct non-negative integers, got {text!r}")
    return sorted(layers)


def _engine_arg(text: str) -> tuple[str, object]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"--engine-arg wants KEY=VALUE, got {text!r}")
    try:
        return key, json.loads(value)
    except json.JSONDecodeError:
        return key, value


def add_model_arguments(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    """The model and vLLM flags (shared with ``hsx run``, which passes them on
    with :func:`as_argv`)."""
    model = parser.add_argument_group("model and vLLM")
    return [
        model.add_argument("--model", required=True, help="model directory (or name vLLM can load)"),
        model.add_argument("--model-name", help="name recorded in manifests (default: the model directory's name)"),
        model.add_argument("--layers", type=_layer_list, help="hidden-state layer ids, e.g. 2,15,27,30 "
                           "(default: EAGLE-3's low/mid/high plus the last, num_hidden_layers)"),
        model.add_argument("--dtype", default=_ENGINE.dtype, help="model dtype: auto, float32, bfloat16, float16 "
                           "(default %(default)s)"),
        model.add_argument("--max-model-len", type=int, default=_ENGINE.max_model_len,
                           help="longest prompt + 1 (default %(default)s)"),
        model.add_argument("--tensor-parallel-size", type=int, default=_ENGINE.tensor_parallel_size),
        model.add_argument("--data-parallel-size", type=int, default=_ENGINE.data_parallel_size),
        model.add_argument("--max-num-seqs", type=int, help="vLLM batch size limit"),
        model.add_argument("--max-num-batched-tokens", type=int, help="vLLM tokens per step"),
        model.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs / compilation"),
        model.add_argument("--engine-arg", type=_engine_arg, action="append", default=[], metavar="KEY=VALUE",
                           help="any other AsyncEngineArgs field (VALUE parsed as JSON when it can be)"),
    ]


def as_argv(actions: list[argparse.Action], args: argparse.Namespace) -> list[str]:
    """The flags of ``actions`` that ``args`` sets (other than to their default),
    written back as command-line words that parse to the same values."""
    argv: list[str] = []
    for action in actions:
        value, flag = getattr(args, action.dest), action.option_strings[0]
        if value is None or value == action.default:
            continue
        if action.nargs == 0:  # store_true
            argv.append(flag)
        elif action.dest == "layers":
            argv += [flag, ",".join(str(layer) for layer in value)]
        elif action.dest == "engine_arg":
            for key, item in value:
                argv += [flag, f"{key}={json.dumps(item)}"]
        else:
            argv += [flag, str(value)]
    return argv


def add_arguments(parser: argparse.ArgumentParser) -> None:
    kafka = parser.add_argument_group("Kafka")
    kafka.add_argument("--bootstrap", help="bootstrap servers (env HSX_KAFKA_BOOTSTRAP)")
    kafka.add_argument("--topic", help="prompts topic (env HSX_TOPIC_PROMPTS)")
    kafka.add_argument("--blocks-topic", help="output topic (env HSX_TOPIC_BLOCKS)")
    kafka.add_argument("--dlq-topic", help="dead-letter topic (env HSX_TOPIC_PROMPTS_DLQ)")
    kafka.add_argument("--group", default=_SERVICE.group_id, help="consumer group id (default %(default)s)")
    kafka.add_argument("--session-timeout-ms", type=int, default=_SERVICE.session_timeout_ms,
                       help="consumer session timeout (default %(default)s)")

    add_model_arguments(parser)

    service = parser.add_argument_group("service")
    service.add_argument("--max-inflight", type=int, default=_SERVICE.max_inflight,
                         help="prompts in flight (default %(default)s)")
    service.add_argument("--max-attempts", type=int, default=_SERVICE.max_attempts,
                         help="attempts before dead-lettering (default %(default)s)")
    service.add_argument("--exit-when-idle", type=float, metavar="SECS", help="stop after SECS with nothing to do")
    service.add_argument("--stall-timeout", type=float, default=_SERVICE.stall_timeout, metavar="SECS",
                         help="exit 1 when no prompt finished for SECS with prompts in flight (default %(default)s)")
    service.add_argument("--health-port", type=int,
                         help="serve /healthz, /readyz, /metrics on this port (off if unset)")
    service.add_argument("--stats-file", type=Path, help="write the final statistics here as JSON")
    service.add_argument("--codec", type=Codec, choices=list(Codec), default=_CONNECTOR["codec"])
    service.add_argument("--codec-level", type=int, default=_CONNECTOR["codec_level"], help="zstd level (default %(default)s)")
    service.add_argument("--block-bytes", type=int, default=_CONNECTOR["block_bytes"],
                         help="target raw bytes per block record (default %(default)s)")
    service.add_argument("--compress-threads", type=int, default=_CONNECTOR["compress_threads"])
    service.add_argument("--max-inflight-bytes", type=int, default=_CONNECTOR["max_inflight_bytes"],
                         help="raw hidden-state bytes awaiting Kafka acks (default %(default)s)")


def options_from_args(args: argparse.Namespace) -> tuple[EngineOptions, ConnectorConfig, ExtractorOptions]:
    config = text_config(args.model)
    layers = args.layers or default_layer_ids(config.num_hidden_layers)
    if max(layers) > config.num_hidden_layers:
        raise UsageError(f"layer ids go up to num_hidden_layers = {config.num_hidden_layers}, got {layers}")
    engine = from_args(EngineOptions, args, layer_ids=layers, engine_args=dict(args.engine_arg))
    # One request of max_model_len tokens must always fit the in-flight budget
    # (4 bytes per element bounds every supported dtype).
    largest = args.max_model_len * len(layers) * config.hidden_size * 4
    connector = from_args(
        ConnectorConfig, args,
        completion_address="ipc://set-by-the-extractor",
        blocks_topic=TopicSettings(**overrides(blocks=args.blocks_topic)).blocks,
        model=args.model_name or Path(args.model).name,
        max_inflight_bytes=max(args.max_inflight_bytes, largest),
    )
    service = from_args(ExtractorOptions, args, group_id=args.group)
    return engine, connector, service


def run(args: argparse.Namespace) -> int:
    kafka = KafkaSettings(**overrides(bootstrap=args.bootstrap))
    redact_secrets(kafka.secret_values())
    topics = TopicSettings(**overrides(prompts=args.topic, blocks=args.blocks_topic, prompts_dlq=args.dlq_topic))
    try:
        engine, connector, service = options_from_args(args)
    except (OSError, ValueError) as exc:  # the model directory or its config
        raise UsageError(str(exc)) from exc
    extractor = Extractor(kafka, topics, engine, connector, service, PromptLimitSettings().limits())
    stats = asyncio.run(extractor.run())
    print(f"extract: {stats.describe()}")
    if args.stats_file:
        args.stats_file.write_bytes(orjson.dumps(stats.as_dict()))
    return 0
