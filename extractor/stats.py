"""The extractor's one stats recorder (see :mod:`hsx.runtime.stats`)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import ClassVar

from prometheus_client import Gauge

from hsx.runtime.stats import Recorder, counted
from hsx.schemas.reports import CompletionReport

_IN_FLIGHT = Gauge("hsx_extractor_prompts_in_flight", "Prompts started and not finished")
_WAITING = Gauge("hsx_extractor_prompts_waiting", "Prompts fetched and not yet started (the local backlog)")


@dataclass
class ExtractorStats(Recorder):
    service: ClassVar[str] = "extractor"

    prompts_done: int = counted("Prompts whose records Kafka acknowledged", metric="prompts")
    tokens: int = counted("Prompt tokens whose hidden states were sent")
    raw_bytes: int = counted("Hidden-state bytes before compression", metric="block_raw_bytes")
    compressed_bytes: int = counted("Hidden-state bytes after compression", metric="block_compressed_bytes")
    kafka_bytes: int = counted("Bytes of the records produced to the blocks topic (keys, values, headers): "
                               "block records and manifests inline, manifests alone by reference")
    dead_lettered: int = counted("Prompts sent to the DLQ", metric="dead_letters", label="error_class")
    retries: int = counted("Extraction attempts retried")
    first_prompt_at: float | None = None
    last_done_at: float | None = None

    def consumed(self) -> None:
        if self.first_prompt_at is None:
            self.first_prompt_at = time.monotonic()

    def in_flight(self, prompts: int, waiting: int) -> None:
        _IN_FLIGHT.set(prompts)
        _WAITING.set(waiting)

    def extracted(self, report: CompletionReport) -> None:
        """One prompt's records are all acknowledged by Kafka."""
        self.add("prompts_done")
        self.add("tokens", report.num_tokens)
        self.add("raw_bytes", report.raw_bytes)
        self.add("compressed_bytes", report.compressed_bytes)
        self.add("kafka_bytes", report.kafka_bytes)
        self.last_done_at = time.monotonic()

    @property
    def busy_seconds(self) -> float:
        """From the first prompt consumed to the last one acknowledged: the
        throughput window, without engine start-up or idle time."""
        if self.first_prompt_at is None or self.last_done_at is None:
            return 0.0
        return self.last_done_at - self.first_prompt_at

    def as_dict(self) -> dict[str, float]:
        seconds = self.busy_seconds
        return {
            "prompts": self.prompts_done,
            "tokens": self.tokens,
            "busy_seconds": round(seconds, 3),
            "tokens_per_second": round(self.tokens / seconds, 1) if seconds else 0.0,
            "raw_bytes": self.raw_bytes,
            "compressed_bytes": self.compressed_bytes,
            "kafka_bytes": self.kafka_bytes,
            "dead_lettered": self.dead_lettered,
            "retries": self.retries,
        }

    def describe(self) -> str:
        d = self.as_dict()
        ratio = self.raw_bytes / self.compressed_bytes if self.compressed_bytes else 0.0
        return (
            f"{d['prompts']} prompts, {d['tokens']} tokens in {d['busy_seconds']:.1f}s "
            f"({d['tokens_per_second']:.0f} tokens/s), {self.raw_bytes} raw → {self.compressed_bytes} "
            f"compressed bytes ({ratio:.2f}x), {self.dead_lettered} dead-lettered, {self.retries} retries"
        )
