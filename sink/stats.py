"""The sink's one stats recorder: every count lands in the final statistics
(``--stats-file``, the closing log line) and in Prometheus at the same time."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass

from prometheus_client import Counter, Gauge

from schemas import ErrorClass
from sink.assembler import Sample

_SAMPLES = Counter("hsx_sink_samples", "Samples written to the dataset")
_TOKENS = Counter("hsx_sink_tokens", "Tokens written to the dataset")
_SHARDS = Counter("hsx_sink_shards", "Shards written")
_READY_EVENTS = Counter("hsx_sink_ready_events", "hidden_states.ready events published")
_DUPLICATES = Counter("hsx_sink_duplicates", "Samples dropped as duplicates")
_REJECTED = Counter("hsx_sink_rejected", "Samples or records sent to the DLQ", ["error_class"])
_BUFFERED_BYTES = Gauge("hsx_sink_buffered_bytes", "Bytes held in memory (pending blocks + open shards)")


@dataclass
class SinkStats:
    samples: int = 0
    tokens: int = 0
    raw_bytes: int = 0
    shards: int = 0
    ready_events: int = 0
    duplicates: int = 0
    rejected: int = 0

    # -- recording ---------------------------------------------------------------------------

    def shard_written(self, samples: Iterable[Sample]) -> None:
        self.shards += 1
        _SHARDS.inc()
        for sample in samples:
            self.samples += 1
            self.tokens += sample.manifest.num_tokens
            self.raw_bytes += len(sample.hidden_states)
            _SAMPLES.inc()
            _TOKENS.inc(sample.manifest.num_tokens)

    def published(self, ready_events: int) -> None:
        self.ready_events += ready_events
        _READY_EVENTS.inc(ready_events)

    def duplicate(self) -> None:
        self.duplicates += 1
        _DUPLICATES.inc()

    def rejected_one(self, error_class: ErrorClass) -> None:
        self.rejected += 1
        _REJECTED.labels(error_class.value).inc()

    def buffered(self, nbytes: int) -> None:
        _BUFFERED_BYTES.set(nbytes)

    # -- reporting ---------------------------------------------------------------------------

    def as_dict(self) -> dict[str, int]:
        return asdict(self)

    def describe(self) -> str:
        return (f"{self.samples} samples ({self.tokens} tokens, {self.raw_bytes} bytes) in {self.shards} shards, "
                f"{self.ready_events} ready events, {self.duplicates} duplicates dropped, {self.rejected} rejected")
