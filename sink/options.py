"""The sink service's options (the command line reads its defaults here)."""

from __future__ import annotations

from dataclasses import dataclass

from hsx.schemas.dataset_codec import DatasetCodec
from hsx.sink.assembler import DEFAULT_MAX_SAMPLE_BYTES


@dataclass(frozen=True)
class SinkOptions:
    output: str
    """The dataset: a directory or ``s3://bucket/prefix`` (:mod:`hsx.dataset.storage`)."""
    group_id: str = "hsx-sink"
    dataset: str | None = None
    """Name used in the deterministic ready-event ids (default: the output's last path part)."""
    max_shard_bytes: int = 1 << 30
    max_shard_samples: int = 10_000
    max_shard_age: float = 60.0
    flush_when_idle: float | None = None
    """Close a partition's open shard once no sample joined it for this many
    seconds (None: only size, count and age close shards). ``hsx run`` sets it, so
    the last samples of a job get their ready events at once."""
    spool_after_bytes: int = 64 << 20
    """On a local dataset, an open shard streams to its file once its samples
    hold this many bytes in memory (:mod:`hsx.dataset.spool`): the sink then
    holds one 8 MiB buffer per shard, not the shard."""
    max_buffer_bytes: int = 2 << 30
    """Bytes held in memory (blocks awaiting manifests + open shards); partitions
    pause above it."""
    max_sample_bytes: int = DEFAULT_MAX_SAMPLE_BYTES
    """A manifest declaring more hidden-state bytes (or a larger staged object) is
    dead-lettered as ``sample_too_large`` before any of its blocks is decoded."""
    incomplete_timeout: float = 600.0
    stall_timeout: float = 600.0
    """/healthz fails once records were pending (fetched and not done, or not
    yet fetched on an assigned partition) for this long with no record fetched or
    finished: the orchestrator restarts the sink. Progress is a record fetched or
    a record done (its sample's shard written and its ready event acknowledged, a
    duplicate dropped, a dead letter acknowledged)."""
    session_timeout_ms: int = 10_000
    commit_interval: float = 1.0
    exit_when_idle: float | None = None
    exactly_once: bool = False
    """Publish ready events and commit offsets in one Kafka transaction."""
    dataset_codec: DatasetCodec = DatasetCodec.RAW
    """How shards store hidden states (``hsx.dataset.encoding``); raw by default, so any
    safetensors reader loads them."""
    upload_part_bytes: int = 16 << 20
    """Multipart part size for an object-store output (at least S3's 5 MiB)."""
    payload_store: str | None = None
    """Where by-reference manifests keep their blocks (``hsx extract
    --payload-store``): a directory or ``s3://bucket/prefix``, the only place
    this sink reads staged objects from. None: a by-reference manifest stops the sink."""
    staged_max_age: float = 7 * 24 * 3600.0
    """The sweep deletes staged objects older than this (:mod:`hsx.sink.payloads`):
    it must exceed the blocks topic's retention (Kafka's default: 7 days)."""
    health_port: int | None = None
    """Serve /healthz, /readyz and /metrics here (0: any free port; None: off)."""
