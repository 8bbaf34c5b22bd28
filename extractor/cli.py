"""``hsx extract``: run an extractor (consumer-group member driving vLLM)."""

from __future__ import annotations

import argparse
import asyncio
import json
from pathlib import Path
from typing import Any, get_args

import orjson
import zstandard

from hsx.dataset.storage import open_payload_store
from hsx.extractor.engine import EngineOptions, default_layer_ids
from hsx.extractor.model_config import hf_config, text_part, vision_language_blocker
from hsx.extractor.options import ExtractorOptions
from hsx.extractor.service import Extractor
from hsx.runtime.checks import bounded, enum_value, integer, model_dir, number, writable_file
from hsx.runtime.errors import UsageError
from hsx.runtime.kafka.admin import add_connect_timeout, wait_for_cluster
from hsx.runtime.logs import redact_secrets
from hsx.runtime.settings import KafkaSettings, PromptLimitSettings, TopicSettings, from_args, overrides
from hsx.schemas import Codec
from hsx.schemas.connector import ConnectorConfig, WireDType, request_bytes_bound

_CONNECTOR = {name: field.default for name, field in ConnectorConfig.model_fields.items()}
_SERVICE = ExtractorOptions()
_ENGINE = EngineOptions(model="", layer_ids=[])
DTYPES = ("auto", "float32", "float", "bfloat16", "float16", "half")
"""The model dtypes vLLM takes (``float`` and ``half`` are its aliases)."""


def _layer_list(text: str) -> list[int]:
    try:
        layers = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--layers wants comma-separated integers, got {text!r}") from None
    if not layers or len(set(layers)) != len(layers) or min(layers) < 0:
        raise argparse.ArgumentTypeError(f"--layers wants distinct non-negative integers, got {text!r}")
    return sorted(layers)


def engine_arg(text: str) -> tuple[str, object]:
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
        model.add_argument("--model", required=True,
                           help="local model directory: config.json and weights (hsx downloads nothing)"),
        model.add_argument("--model-name", help="name recorded in manifests (default: the model directory's name)"),
        model.add_argument("--layers", type=_layer_list, help="hidden-state layer ids, e.g. 2,15,27,30 "
                           "(default: EAGLE-3's low/mid/high plus the last, num_hidden_layers)"),
        model.add_argument("--dtype", default=_ENGINE.dtype, choices=DTYPES, help="model dtype (default %(default)s)"),
        # 2: the shortest prompt, one token, plus the one token the engine runs for.
        model.add_argument("--max-model-len", type=integer(2),
                           help=f"longest prompt + 1 (default {_ENGINE.max_model_len}, or the model's context "
                                "where that is shorter)"),
        model.add_argument("--tensor-parallel-size", type=integer(1), default=_ENGINE.tensor_parallel_size),
        model.add_argument("--data-parallel-size", type=integer(1), default=_ENGINE.data_parallel_size),
        model.add_argument("--pipeline-parallel-size", type=integer(1), default=1,
                           help="1 only: the hidden states of every chosen layer must reach one rank"),
        model.add_argument("--max-num-seqs", type=integer(1), help="vLLM batch size limit"),
        model.add_argument("--max-num-batched-tokens", type=integer(1), help="vLLM tokens per step"),
        model.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs / compilation"),
        model.add_argument("--engine-arg", type=engine_arg, action="append", default=[], metavar="KEY=VALUE",
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
    kafka.add_argument("--session-timeout-ms", type=integer(1), default=_SERVICE.session_timeout_ms,
                       help="consumer session timeout (default %(default)s)")
    add_connect_timeout(kafka, None)

    add_model_arguments(parser)

    service = parser.add_argument_group("service")
    service.add_argument("--max-inflight", type=integer(1), default=_SERVICE.max_inflight,
                         help="prompts in flight (default %(default)s)")
    service.add_argument("--max-attempts", type=integer(1), default=_SERVICE.max_attempts,
                         help="attempts before dead-lettering (default %(default)s)")
    service.add_argument("--exit-when-idle", type=number(0), metavar="SECS",
                         help="stop after SECS with nothing to do, counted from joining the group")
    service.add_argument("--stall-timeout", type=number(above=0), default=_SERVICE.stall_timeout, metavar="SECS",
                         help="exit 1 when no prompt finished for SECS with prompts in flight; /healthz fails when "
                              "prompts were pending for SECS without one fetched or finished (default %(default)s)")
    service.add_argument("--health-port", type=integer(0, 65535),
                         help="serve /healthz, /readyz, /metrics on this port (off if unset)")
    service.add_argument("--stats-file", type=Path, help="write the final statistics here as JSON")
    service.add_argument("--codec", type=enum_value(Codec), choices=list(Codec), default=_CONNECTOR["codec"],
                         metavar="{" + ",".join(c.value for c in Codec) + "}")
    service.add_argument("--wire-dtype", choices=list(get_args(WireDType)), default=_CONNECTOR["wire_dtype"],
                         help="what block records carry: 'model', the hidden states in the model's dtype "
                              "(lossless); 'fp8', E4M3 codes with a float32 scale per token and layer, "
                              "quantized on the device before the copy to the host: half of bf16's bytes "
                              "before compression, about 0.6x after (SmolLM2); each element's error is at "
                              "most 2**-4 of it or 2**-10 of its row's scale (schemas/fp8.py). Needs a sink of "
                              "this version: its --dataset-codec fp8/fp8-zstd stores the codes as sent, the "
                              "others dequantize (default %(default)s)")
    service.add_argument("--payload-store", metavar="URL",
                         help="send hidden states by reference: each attempt's blocks go into one object in URL "
                              "(a directory the sinks can read, or s3://BUCKET/PREFIX; credentials from the usual "
                              "AWS chain) and only its manifest goes to Kafka; the sinks need the same "
                              "--payload-store (default: inline, every block through Kafka)")
    service.add_argument("--codec-level", type=integer(high=zstandard.MAX_COMPRESSION_LEVEL),
                         default=_CONNECTOR["codec_level"], help="zstd level (default %(default)s)")
    service.add_argument("--block-bytes", type=bounded(ConnectorConfig, "block_bytes"), default=_CONNECTOR["block_bytes"],
                         help="target raw bytes per block (default: 1 MiB inline, a Kafka record each; "
                              "8 MiB with --payload-store)")
    service.add_argument("--compress-threads", type=bounded(ConnectorConfig, "compress_threads"),
                         default=_CONNECTOR["compress_threads"],
                         help="threads encoding block records inline; with --payload-store each of the "
                              f"{_CONNECTOR['upload_threads']} staging threads encodes what it writes "
                              "(default %(default)s)")
    service.add_argument("--max-inflight-bytes", type=bounded(ConnectorConfig, "max_inflight_bytes"),
                         default=_CONNECTOR["max_inflight_bytes"],
                         help="raw hidden-state bytes awaiting Kafka acks (default %(default)s)")


def check_layout(args: argparse.Namespace) -> None:
    """Refuse pipeline parallelism (the flag or ``--engine-arg``) in one line:
    vLLM's ``extract_hidden_states`` draft stores the chosen layers' hidden states
    on the rank that runs the last layer, and with pipeline stages the other
    layers run elsewhere. Tensor and data parallelism are supported."""
    engine_arg = dict(args.engine_arg).get("pipeline_parallel_size", 1)
    for flag, value in (("--pipeline-parallel-size", args.pipeline_parallel_size),
                        ("--engine-arg pipeline_parallel_size", engine_arg)):
        if value != 1:
            raise UsageError(f"{flag} {value}: hidden-state extraction does not support pipeline parallelism "
                             f"(the chosen layers must run on one rank); spread the model with "
                             f"--tensor-parallel-size instead")


def model_and_layers(args: argparse.Namespace) -> tuple[Any, list[int]]:
    """The model's text config and the layer ids (``--layers`` or the default),
    checked against it; :class:`UsageError` for a directory that is not a model
    (before transformers could take it for a hub id) or layers it lacks. Also
    settles ``args.max_model_len`` against the model's context (see
    :func:`_max_model_len`), so ``hsx run`` passes the settled value on. Shared
    with ``hsx run``, which checks before it starts anything."""
    model_dir("--model", args.model)
    try:
        model_config = hf_config(args.model)
    except (OSError, ValueError) as exc:  # an unreadable or unknown config.json
        raise UsageError(f"--model {args.model}: {exc}") from exc
    if (blocker := vision_language_blocker(model_config)) is not None:  # else vLLM's traceback, minutes later
        raise UsageError(f"--model {args.model}: {blocker}")
    config = text_part(model_config)
    layers = args.layers or default_layer_ids(config.num_hidden_layers)
    if max(layers) > config.num_hidden_layers:
        raise UsageError(f"layer ids go up to num_hidden_layers = {config.num_hidden_layers}, got {layers} (--layers)")
    args.max_model_len = _max_model_len(args.max_model_len, getattr(config, "max_position_embeddings", None))
    return config, layers


def _max_model_len(asked: int | None, context: int | None) -> int:
    """``--max-model-len``: by default 4096, or the model's context where that is
    shorter (vLLM refuses more, with a traceback); more than the context, asked
    for, is a usage error."""
    if asked is None:
        return min(_ENGINE.max_model_len, context) if context else _ENGINE.max_model_len
    if context and asked > context:
        raise UsageError(f"--max-model-len {asked} is more than the model's context of {context} tokens "
                         f"(max_position_embeddings in its config.json)")
    return asked


def options_from_args(args: argparse.Namespace) -> tuple[EngineOptions, ConnectorConfig, ExtractorOptions]:
    check_layout(args)
    config, layers = model_and_layers(args)
    engine = from_args(EngineOptions, args, layer_ids=layers, engine_args=dict(args.engine_arg))
    # ConnectorConfig requires the budget to hold one request of max_model_len
    # tokens; a smaller --max-inflight-bytes is raised to that.
    largest = request_bytes_bound(args.max_model_len, len(layers), config.hidden_size)
    connector = from_args(
        ConnectorConfig, args,
        requests="extractor",
        completion_address="ipc://set-by-the-extractor",
        kafka_settings_file="set-by-the-extractor",
        blocks_topic=TopicSettings(**overrides(blocks=args.blocks_topic)).blocks,
        model=args.model_name or Path(args.model).name,
        max_inflight_bytes=max(args.max_inflight_bytes, largest),
        max_request_bytes=largest,
    )
    service = from_args(ExtractorOptions, args, group_id=args.group)
    return engine, connector, service


def run(args: argparse.Namespace) -> int:
    kafka = KafkaSettings(**overrides(bootstrap=args.bootstrap))
    redact_secrets(kafka.secret_values())
    topics = TopicSettings(**overrides(prompts=args.topic, blocks=args.blocks_topic, prompts_dlq=args.dlq_topic))
    if args.stats_file:
        writable_file("--stats-file", args.stats_file)
    try:
        engine, connector, service = options_from_args(args)
    except ValueError as exc:  # a value the options reject (pydantic's ValidationError is one)
        raise UsageError(str(exc)) from exc
    if connector.payload_store:  # a wrong key or bucket is refused at once, in one line
        open_payload_store(connector.payload_store)
    # Before the service: it takes SIGINT as a drain, so a Ctrl-C during this wait
    # (for ever by default) would otherwise go unheard.
    wait_for_cluster(kafka, args.connect_timeout)
    extractor = Extractor(kafka, topics, engine, connector, service, PromptLimitSettings().limits())
    stats = asyncio.run(extractor.run())
    print(f"extract: {stats.describe()}")
    if args.stats_file:
        args.stats_file.write_bytes(orjson.dumps(stats.as_dict()))
    return 0
