"""The extractor service's options (the command line reads its defaults here)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ExtractorOptions:
    group_id: str = "hsx-extractor"
    max_inflight: int = 64
    """Prompts consumed but not finished; beyond it partitions are paused."""
    max_attempts: int = 3
    completion_timeout: float = 600.0
    """Seconds to wait for the connector's report after vLLM's output."""
    commit_interval: float = 1.0
    session_timeout_ms: int = 10_000
    exit_when_idle: float | None = None
    """Stop after this many seconds with nothing to do (batch runs)."""
    drain_timeout: float = 300.0
    """On SIGTERM, how long in-flight prompts may take to finish."""
    stall_timeout: float = 600.0
    """With prompts in flight and none finished for this long, the engine is taken
    to be stuck: the service stops (exit 1) so its orchestrator restarts it;
    nothing unfinished was committed, so the restart reprocesses it. Beyond that,
    /healthz fails once prompts were pending (in flight, or not yet fetched on an
    assigned partition) this long with none fetched or finished (acknowledged by
    Kafka or dead-lettered): a member that stopped fetching is restarted too."""
    health_port: int | None = None
    """Serve /healthz, /readyz and /metrics here (0: any free port; None: off)."""
