"""What a run did, as the table ``hsx run`` and ``hsx demo`` print at the end."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from hsx.dataset.storage import open_storage
from hsx.running.ledger import Ledger
from hsx.producer.publisher import PublishSummary


@dataclass
class RunReport:
    output: str
    """The dataset: a directory or ``s3://bucket/prefix``."""
    published: PublishSummary
    ledger: Ledger
    extracted: dict[str, Any]
    """The extractor's final statistics (``--stats-file``)."""
    sunk: dict[str, Any]
    """The sink's final statistics."""
    wall_seconds: float
    failures: list[str] = field(default_factory=list)
    """Services that did not finish cleanly, and why."""
    payload_store: str | None = None
    """Where hidden states were staged; ``None``: inline, through Kafka."""

    @property
    def lost(self) -> set[str]:
        return self.ledger.missing

    @property
    def ok(self) -> bool:
        """Every published prompt has a sample, and both services finished cleanly."""
        return not self.failures and not self.lost and not self.ledger.failed

    def stored_bytes(self) -> int:
        """Bytes stored of the shards this run wrote."""
        storage = open_storage(self.output)
        total = 0
        for shard in {event.shard for event in self.ledger.ready.values()}:
            try:
                total += storage.size(shard)
            except FileNotFoundError:
                continue
        return total

    def rows(self) -> list[tuple[str, str]]:
        ledger, summary = self.ledger, self.published
        samples = ledger.samples
        tokens = sum(ledger.ready[r].num_tokens for r in samples)
        raw, stored = self.sunk.get("raw_bytes", 0), self.stored_bytes()
        kafka, done_tokens = self.extracted.get("kafka_bytes", 0), self.extracted.get("tokens", 0)
        by_class = ", ".join(f"{c} {n}" for c, n in sorted(ledger.dead_letters_by_class().items()))
        rows = [
            ("prompts published", f"{summary.sent}"),
            ("skipped (already in the dataset)", f"{summary.skipped}"),
            ("invalid input lines", f"{summary.invalid}"),
            ("samples written", f"{len(samples)}"),
            ("tokens", f"{tokens:,}"),
            ("dead letters", f"{len(ledger.failed)}" + (f" ({by_class})" if by_class else "")),
            ("lost", f"{len(self.lost)}"),
            *([("records not hsx's, skipped", f"{ledger.foreign}")] if ledger.foreign else []),
            ("hidden-state bytes raw → stored", f"{raw:,} → {stored:,}" + (f" ({raw / stored:.2f}x)" if stored else "")),
            ("transport", f"by reference, staged in {self.payload_store}" if self.payload_store
             else "inline (block records through Kafka)"),
            ("Kafka bytes per token (blocks topic)", f"{kafka / done_tokens:,.1f}" if done_tokens else "–"),
            ("extraction tokens/s", f"{self.extracted.get('tokens_per_second', 0.0):.0f}"),
            ("wall time", f"{self.wall_seconds:.0f} s"),
        ]
        rows += self._generation_rows(samples)
        rows += [("failed", failure) for failure in self.failures]
        return rows

    def _generation_rows(self, samples: set[str]) -> list[tuple[str, str]]:
        """Answers the verifier generated, when any prompt asked for them."""
        turns = [turn for r in samples if (g := self.ledger.ready[r].generation) is not None for turn in g.turns]
        if not turns:
            return []
        reasons = Counter(turn.finish_reason for turn in turns)
        return [
            ("answers generated", f"{len(turns)} in {sum(1 for r in samples if self.ledger.ready[r].generation)} "
                                  f"samples ({', '.join(f'{k} {v}' for k, v in sorted(reasons.items()))})"),
            ("tokens generated", f"{sum(turn.token_end - turn.token_start for turn in turns):,}"),
        ]


def render(rows: list[tuple[str, str]]) -> str:
    """Two aligned columns."""
    width = max(len(name) for name, _ in rows)
    return "\n".join(f"  {name:<{width}}  {value}" for name, value in rows)
