"""What ``hsx run`` needs, checked before anything starts (:class:`RunPlan`),
and what it derives for its services from that: where logs and staged hidden
states go, and the extractor's codec."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from hsx.dataset.storage import dataset_name, is_object_store, open_payload_store, open_storage
from hsx.producer.publisher import InvalidPolicy, Mapping
from hsx.producer.sources import SourceLine
from hsx.runtime.checks import model_dir, writable_dir
from hsx.runtime.kafka.admin import ONE_SHOT_CONNECT_TIMEOUT
from hsx.schemas import Codec
from hsx.schemas.connector import WireDType
from hsx.schemas.dataset_codec import DatasetCodec

STAGING = "staging"
"""The run's own staging folder's name, beside the dataset."""


def own_staging_codec(dataset_codec: DatasetCodec) -> Codec | None:
    """The wire codec for hidden states staged in a folder of the command's own
    (``hsx run``, ``hsx serve``) for its own sink: ``none`` for a raw dataset,
    else ``None`` (the connector's default).

    Why: those staged bytes stay on this machine only until the sink stores
    them, and for a raw dataset the sink decompresses them at once; with
    them compressed, the path spent about 1 CPU-second per GB more
    (``bench.datapath`` with ``--dataset-codec raw``, by reference on a
    directory, one round each: connector side 1.28 -> 0.80, sink 1.49 ->
    1.00 CPU-s per GB) for 1.4x the staged bytes."""
    return Codec.NONE if dataset_codec is DatasetCodec.RAW else None


@dataclass
class RunPlan:
    """Everything a run needs, checked before anything starts."""

    model: Path
    output: str
    """A directory or ``s3://bucket/prefix``."""
    lines: Iterable[SourceLine]
    mapping: Mapping = field(default_factory=Mapping)
    on_invalid: InvalidPolicy = InvalidPolicy.SKIP
    engine_argv: list[str] = field(default_factory=list)
    """``hsx extract`` flags for the model and vLLM (``--model`` aside)."""
    bootstrap: str | None = None
    partitions: int = 2
    progress: bool = True
    connect_timeout: float | None = ONE_SHOT_CONNECT_TIMEOUT
    """How long a cluster named by ``bootstrap`` may take to answer (``None``: for ever)."""
    log_dir: Path | None = None
    """Where the services' logs go (default: see :attr:`logs`)."""
    dataset_codec: DatasetCodec = DatasetCodec.RAW
    """The sink's ``--dataset-codec``."""
    wire_dtype: WireDType = "model"
    """The extractor's ``--wire-dtype``."""
    payload_store: str | None = None
    """Where hidden states are staged (the services' ``--payload-store``); by
    default :attr:`staging`."""
    inline: bool = False
    """Hidden states through Kafka instead (no payload store)."""

    def __post_init__(self) -> None:
        model_dir("--model", self.model)
        self.output = str(self.output)  # a Path is accepted too
        if is_object_store(self.output):
            open_storage(self.output)  # a wrong key or bucket refused now, not by the sink later
        else:
            writable_dir("--output", Path(self.output))
        if self.payload_store is not None:
            open_payload_store(self.payload_store)  # refused now, not by the services later

    @property
    def logs(self) -> Path:
        """Where the services' logs go: ``log_dir``, else beside the dataset, or
        locally for an object store."""
        if self.log_dir is not None:
            return self.log_dir
        if is_object_store(self.output):
            return Path("hsx-logs") / dataset_name(self.output)
        return Path(self.output) / "logs"

    @property
    def staging(self) -> str | None:
        """The payload store, ``None`` inline. By default a folder of the run's own,
        beside the dataset (``OUTPUT/staging``; for an object store, in the logs'
        folder): nothing but this run's sink reads it, so it is emptied at the end."""
        if self.inline:
            return None
        if self.payload_store is not None:
            return self.payload_store
        return str((self.logs if is_object_store(self.output) else Path(self.output)) / STAGING)

    @property
    def owns_staging(self) -> bool:
        """Whether :attr:`staging` is the run's own folder, removed before and after."""
        return not self.inline and self.payload_store is None

    @property
    def wire_codec(self) -> Codec | None:
        """The extractor's ``--codec`` where the run chooses it (:func:`own_staging_codec`)."""
        return own_staging_codec(self.dataset_codec) if self.owns_staging else None
