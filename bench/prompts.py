"""The prompt set benchmarks share: the bundled demo mix, rendered by a tokenizer."""

from __future__ import annotations

from importlib import resources
from typing import Any

import orjson

from extractor.prompts import PromptPreparer
from schemas import PromptEvent


def demo_events() -> list[PromptEvent]:
    data = resources.files("hsx") / "data" / "demo_prompts.jsonl"
    return [PromptEvent.model_validate_json(orjson.dumps(orjson.loads(line))) for line in data.read_bytes().splitlines()]


def demo_token_ids(tokenizer: Any, max_model_len: int = 4096, repeat: int = 1) -> list[list[int]]:
    """Token ids of the demo prompts as the extractor would feed them."""
    preparer = PromptPreparer(tokenizer, len(tokenizer), max_model_len)
    return [preparer.prepare(e).token_ids for e in demo_events()] * repeat
