"""The sink's one stats recorder (see :mod:`hsx.runtime.stats`)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import ClassVar

from prometheus_client import Gauge

from hsx.dataset.sample import Sample
from hsx.runtime.stats import Recorder, counted

_BUFFERED_BYTES = Gauge("hsx_sink_buffered_bytes", "Bytes held in memory (pending blocks, open shards, shards not yet written)")
_UNWRITTEN_SAMPLES = Gauge("hsx_sink_unwritten_samples",
                           "Samples read, in shards not yet written (rises while the disk or object store is slow)")
_KNOWN_SAMPLES = Gauge("hsx_sink_known_samples", "Samples of the assigned partitions already in the dataset (dedupe keys held)")
_LOAD_SECONDS = Gauge("hsx_sink_partition_load_seconds", "Seconds the last assignment spent loading its partitions' dedupe keys")


@dataclass
class SinkStats(Recorder):
    service: ClassVar[str] = "sink"

    samples: int = counted("Samples written to the dataset")
    tokens: int = counted("Tokens written to the dataset")
    raw_bytes: int = counted("Hidden-state bytes written to the dataset")
    shards: int = counted("Shards written")
    ready_events: int = counted("hidden_states.ready events published")
    duplicates: int = counted("Samples dropped as duplicates")
    rejected: int = counted("Samples or records sent to the DLQ", label="error_class")

    def shard_written(self, samples: Iterable[Sample]) -> None:
        self.add("shards")
        for sample in samples:
            self.add("samples")
            self.add("tokens", sample.manifest.num_tokens)
            self.add("raw_bytes", len(sample.hidden_states))

    def buffered(self, nbytes: int, unwritten_samples: int) -> None:
        _BUFFERED_BYTES.set(nbytes)
        _UNWRITTEN_SAMPLES.set(unwritten_samples)

    def partitions_loaded(self, seconds: float, known_samples: int) -> None:
        """An assignment loaded its partitions' keys; ``known_samples``: of all assigned partitions."""
        _LOAD_SECONDS.set(seconds)
        _KNOWN_SAMPLES.set(known_samples)

    def as_dict(self) -> dict[str, int]:
        return asdict(self)

    def describe(self) -> str:
        return (f"{self.samples} samples ({self.tokens} tokens, {self.raw_bytes} bytes) in {self.shards} shards, "
                f"{self.ready_events} ready events, {self.duplicates} duplicates dropped, {self.rejected} rejected")
