"""The extractor's one stats recorder: every count lands in the final statistics
(``--stats-file``, the closing log line) and in Prometheus at the same time."""

from __future__ import annotations

import time
from dataclasses import dataclass

from prometheus_client import Counter, Gauge

from schemas import ErrorClass
from schemas.connector import CompletionReport

_PROMPTS = Counter("hsx_extractor_prompts", "Prompts whose records Kafka acknowledged")
_TOKENS = Counter("hsx_extractor_tokens", "Prompt tokens whose hidden states were sent")
_IN_FLIGHT = Gauge("hsx_extractor_prompts_in_flight", "Prompts consumed but not finished")
_RAW_BYTES = Counter("hsx_extractor_block_raw_bytes", "Hidden-state bytes before compression")
_COMPRESSED_BYTES = Counter("hsx_extractor_block_compressed_bytes", "Hidden-state bytes after compression")
_DEAD_LETTERS = Counter("hsx_extractor_dead_letters", "Prompts sent to the DLQ", ["error_class"])
_RETRIES = Counter("hsx_extractor_retries", "Extraction attempts retried")


@dataclass
class ExtractorStats:
    prompts_done: int = 0
    tokens: int = 0
    raw_bytes: int = 0
    compressed_bytes: int = 0
    dead_lettered: int = 0
    retries: int = 0
    first_prompt_at: float | None = None
    last_done_at: float | None = None

    # -- recording ---------------------------------------------------------------------------

    def consumed(self) -> None:
        if self.first_prompt_at is None:
            self.first_prompt_at = time.monotonic()

    def in_flight(self, prompts: int) -> None:
        _IN_FLIGHT.set(prompts)

    def extracted(self, report: CompletionReport) -> None:
        """One prompt's records are all acknowledged by Kafka."""
        self.prompts_done += 1
        self.tokens += report.num_tokens
        self.raw_bytes += report.raw_bytes
        self.compressed_bytes += report.compressed_bytes
        self.last_done_at = time.monotonic()
        _PROMPTS.inc()
        _TOKENS.inc(report.num_tokens)
        _RAW_BYTES.inc(report.raw_bytes)
        _COMPRESSED_BYTES.inc(report.compressed_bytes)

    def retried(self) -> None:
        self.retries += 1
        _RETRIES.inc()

    def dead_lettered_one(self, error_class: ErrorClass) -> None:
        self.dead_lettered += 1
        _DEAD_LETTERS.labels(error_class.value).inc()

    # -- reporting ---------------------------------------------------------------------------

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
