"""Default topic names. Services read the names actually used from settings
(``HSX_TOPIC_*``); these are the defaults every component agrees on."""

from __future__ import annotations

from dataclasses import dataclass

PROMPTS = "prompts"
PROMPTS_DLQ = "prompts.dlq"
BLOCKS = "hidden_states.blocks"
BLOCKS_DLQ = "hidden_states.blocks.dlq"
READY = "hidden_states.ready"


@dataclass(frozen=True)
class Topics:
    """The four topics of the pipeline plus the sink's dead-letter topic."""

    prompts: str = PROMPTS
    prompts_dlq: str = PROMPTS_DLQ
    blocks: str = BLOCKS
    blocks_dlq: str = BLOCKS_DLQ
    ready: str = READY
