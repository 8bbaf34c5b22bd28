"""``hsx extract|sink|produce`` command lines (without ``hsx`` itself) for the
services ``hsx run`` starts, and for development runs: the demo, the benchmarks
and the tests.

They share what such runs want: one topic set's names, a short consumer session
(:data:`SESSION_TIMEOUT_MS`) so that a restarted or an added service gets its
partitions within seconds (runs that never replace a member ask for
:data:`STEADY_SESSION_TIMEOUT_MS` instead), and (development runs; ``hsx run`` passes the user's
flags instead) an extractor with a float32 model without CUDA graphs or
compilation (CPU machines; exact comparisons with HF transformers).
Callers append their own flags; a flag given twice takes the last value.
"""

from __future__ import annotations

from pathlib import Path

from hsx.runtime.settings import TopicSettings

SESSION_TIMEOUT_MS = 6000
"""For runs that kill or add members: the others take over within seconds."""

STEADY_SESSION_TIMEOUT_MS = 12_000
"""For runs that never replace a member (``hsx run``, engine tests). A short
session buys nothing there and costs a spurious rebalance whenever the machine
is starved for a few seconds (a CPU engine running two ranks on two cores: no
heartbeat answered for 6-7 s once): the member loses its partitions and
extracts its prompts in flight a second time. Not longer, because the embedded
broker (tansu) holds a new group's first join for half the session (6 s here,
3 s at 6 s, 10 s at 20 s), and every run waits for its extractor's join."""


def _group(group: str | None) -> list[str]:
    return [] if group is None else ["--group", group]


DEV_ENGINE_FLAGS = ("--dtype", "float32", "--enforce-eager")
"""What development runs want of the engine: exact float32, no compilation."""


def extract_command(bootstrap: str, topics: TopicSettings, model: Path, *extra: str,
                    group: str | None = None, engine_flags: tuple[str, ...] = DEV_ENGINE_FLAGS,
                    session_timeout_ms: int = SESSION_TIMEOUT_MS) -> list[str]:
    """``hsx extract``: prompts topic in, blocks topic out, prompt DLQ."""
    return ["extract", "--bootstrap", bootstrap, "--topic", topics.prompts, "--blocks-topic", topics.blocks,
            "--dlq-topic", topics.prompts_dlq, *_group(group), "--model", str(model), *engine_flags,
            "--session-timeout-ms", str(session_timeout_ms), *extra]


def sink_command(bootstrap: str, topics: TopicSettings, output: str | Path, *extra: str,
                 group: str | None = None, session_timeout_ms: int = SESSION_TIMEOUT_MS) -> list[str]:
    """``hsx sink``: blocks topic in, a dataset in ``output``, ready events out,
    block DLQ."""
    return ["sink", "--bootstrap", bootstrap, "--output", str(output), "--topic", topics.blocks, "--ready-topic",
            topics.ready, "--dlq-topic", topics.blocks_dlq, *_group(group), "--session-timeout-ms",
            str(session_timeout_ms), *extra]


def produce_command(bootstrap: str, topics: TopicSettings, source: Path, *extra: str) -> list[str]:
    """``hsx produce``: a JSONL file onto the prompts topic, no progress bar."""
    return ["produce", str(source), "--bootstrap", bootstrap, "--topic", topics.prompts, "--no-progress", *extra]
