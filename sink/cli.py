"""``hsx sink``: write hidden-state blocks into a sharded safetensors dataset."""

from __future__ import annotations

import argparse
from pathlib import Path

import orjson

from hsx.dataset.storage import is_object_store, open_payload_store, open_storage
from hsx.dataset.storage.s3 import MIN_PART_BYTES
from hsx.runtime.checks import integer, number, writable_dir, writable_file
from hsx.runtime.kafka.admin import add_connect_timeout, wait_for_cluster
from hsx.runtime.logs import redact_secrets
from hsx.runtime.settings import KafkaSettings, TopicSettings, from_args, overrides
from hsx.schemas.dataset_codec import DatasetCodec
from hsx.sink.options import SinkOptions
from hsx.sink.service import Sink

_DEFAULTS = SinkOptions(output=".")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--bootstrap", help="bootstrap servers (env HSX_KAFKA_BOOTSTRAP)")
    add_connect_timeout(parser, None)
    parser.add_argument("--output", required=True,
                        help="the dataset: a directory, or s3://BUCKET/PREFIX (configured by AWS_ENDPOINT_URL, "
                             "AWS_REGION, AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY or the usual AWS credential chain)")
    parser.add_argument("--topic", help="blocks topic (env HSX_TOPIC_BLOCKS)")
    parser.add_argument("--ready-topic", help="ready events topic (env HSX_TOPIC_READY)")
    parser.add_argument("--dlq-topic", help="dead-letter topic (env HSX_TOPIC_BLOCKS_DLQ)")
    parser.add_argument("--group", default=_DEFAULTS.group_id, help="consumer group id (default %(default)s)")
    parser.add_argument("--dataset-name", help="name in ready-event ids (default: the output folder's name)")
    parser.add_argument("--max-shard-bytes", type=integer(1), default=_DEFAULTS.max_shard_bytes,
                        help="close a shard at this size (default %(default)s)")
    parser.add_argument("--max-shard-samples", type=integer(1), default=_DEFAULTS.max_shard_samples,
                        help="close a shard at this many samples (default %(default)s)")
    parser.add_argument("--max-shard-age", type=number(above=0), default=_DEFAULTS.max_shard_age, metavar="SECS",
                        help="close a shard after SECS (default %(default)s)")
    parser.add_argument("--flush-when-idle", type=number(above=0), metavar="SECS",
                        help="close an open shard after SECS without a new sample (default: off)")
    parser.add_argument("--spool-after-bytes", type=integer(1), default=_DEFAULTS.spool_after_bytes,
                        help="on a directory output, stream an open shard to its file once its samples hold this "
                             "many bytes in memory, holding one 8 MiB buffer instead (default %(default)s)")
    parser.add_argument("--max-buffer-bytes", type=integer(1), default=_DEFAULTS.max_buffer_bytes,
                        help="memory budget; pause above it (default %(default)s)")
    parser.add_argument("--max-sample-bytes", type=integer(1), default=_DEFAULTS.max_sample_bytes,
                        help="dead-letter a manifest declaring more hidden-state bytes, before decoding any of "
                             "its blocks (default %(default)s)")
    parser.add_argument("--incomplete-timeout", type=number(above=0), default=_DEFAULTS.incomplete_timeout,
                        metavar="SECS",
                        help="reject blocks whose manifest has not come after SECS (default %(default)s)")
    parser.add_argument("--session-timeout-ms", type=integer(1), default=_DEFAULTS.session_timeout_ms)
    parser.add_argument("--commit-interval", type=number(above=0), default=_DEFAULTS.commit_interval, metavar="SECS",
                        help="commit offsets, first deleting the staged objects stored samples no longer need, "
                             "every SECS (default %(default)s)")
    parser.add_argument("--stall-timeout", type=number(above=0), default=_DEFAULTS.stall_timeout, metavar="SECS",
                        help="fail /healthz when records were pending for SECS without one fetched or finished "
                             "(default %(default)s)")
    parser.add_argument("--dataset-codec", choices=[c.value for c in DatasetCodec],
                        default=_DEFAULTS.dataset_codec.value,
                        help="how shards store hidden states: raw (any safetensors reader loads them), "
                             "byteplane-zstd (lossless, the block records as they came), fp8 or fp8-zstd "
                             "(E4M3, a scale per token and layer); hsx's readers decode all (default %(default)s)")
    parser.add_argument("--upload-part-bytes", type=integer(MIN_PART_BYTES), default=_DEFAULTS.upload_part_bytes,
                        help="multipart part size for an s3:// output (default %(default)s); uploads read the "
                             "open shard's memory, so a shard is never copied")
    parser.add_argument("--payload-store", metavar="URL",
                        help="where the extractor stages hidden states (its --payload-store: a directory or "
                             "s3://BUCKET/PREFIX): the only place by-reference manifests are read from; each "
                             "staged object is deleted once its manifest is committed")
    parser.add_argument("--staged-max-age", type=number(above=0), default=_DEFAULTS.staged_max_age, metavar="SECS",
                        help="delete staged objects older than SECS from the payload store (those no manifest "
                             "names); keep it above the blocks topic's retention (default %(default)s: 7 days)")
    parser.add_argument("--exit-when-idle", type=number(0), metavar="SECS",
                        help="stop after SECS with nothing to read, counted from joining the group")
    parser.add_argument("--exactly-once", action="store_true",
                        help="ready events and offset commits in one Kafka transaction (needs a broker with full "
                             "transaction support, e.g. Apache Kafka)")
    parser.add_argument("--health-port", type=integer(0, 65535),
                        help="serve /healthz, /readyz, /metrics on this port (off if unset)")
    parser.add_argument("--stats-file", type=Path, help="write the final statistics here as JSON")


def run(args: argparse.Namespace) -> int:
    kafka = KafkaSettings(**overrides(bootstrap=args.bootstrap))
    redact_secrets(kafka.secret_values())
    topics = TopicSettings(**overrides(blocks=args.topic, ready=args.ready_topic, blocks_dlq=args.dlq_topic))
    if not is_object_store(args.output):
        writable_dir("--output", Path(args.output))
    if args.stats_file:
        writable_file("--stats-file", args.stats_file)
    options = from_args(SinkOptions, args, group_id=args.group, dataset=args.dataset_name,
                        dataset_codec=DatasetCodec(args.dataset_codec))
    # Before the broker: a wrong key or bucket is refused at once, in one line.
    storage = open_storage(options.output, create=True, part_bytes=options.upload_part_bytes)
    payloads = open_payload_store(options.payload_store) if options.payload_store else None
    # Before the service: it takes SIGINT as a drain, so a Ctrl-C during this wait
    # (for ever by default) would otherwise go unheard.
    wait_for_cluster(kafka, args.connect_timeout)
    stats = Sink(kafka, topics, options, storage, payloads).run()
    print(f"sink: {stats.describe()}")
    if args.stats_file:
        args.stats_file.write_bytes(orjson.dumps(stats.as_dict()))
    return 0
