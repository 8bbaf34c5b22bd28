"""The prompt set benchmarks share: the bundled demo mix, rendered by a tokenizer."""

from __future__ import annotations

from importlib import resources
from typing import Any

import orjson

from hsx.extractor.prompts import PromptPreparer
from hsx.schemas import PromptEvent


def demo_events() -> list[PromptEvent]:
    data = resources.files("hsx") / "data" / "demo_prompts.jsonl"
    return [PromptEvent.model_validate_json(orjson.dumps(orjson.loads(line))) for line in data.read_bytes().splitlines()]


def demo_token_ids(tokenizer: Any, max_model_len: int = 4096, repeat: int = 1) -> list[list[int]]:
    """Token ids of the demo prompts as the extractor would feed them."""
    preparer = PromptPreparer(tokenizer, len(tokenizer), max_model_len)
    return [preparer.prepare(e).token_ids for e in demo_events()] * repeat


def prompt_of_length(tokenizer: Any, length: int, salt: int = 0) -> list[int]:
    """A prompt of exactly ``length`` tokens: the demo prompts' token ids one after
    another (real text, so real hidden states), first token made distinct by ``salt``."""
    pool = [t for ids in demo_token_ids(tokenizer) for t in ids]
    ids = (pool * (length // len(pool) + 1))[: length - 1]
    return [100 + salt] + ids


def workload(tokenizer: Any, long_lengths: list[int], repeat: int = 1) -> list[list[int]]:
    """The benchmark mix: the 64 demo prompts (short chats and texts, the
    per-request overhead) plus prompts of the given lengths (the bulk of the
    tokens), ``repeat`` times, every prompt distinct."""
    prompts = []
    for copy in range(repeat):
        prompts += [[100 + copy] + ids for ids in demo_token_ids(tokenizer)]
        prompts += [prompt_of_length(tokenizer, n, salt=copy * 64 + i) for i, n in enumerate(long_lengths)]
    return prompts
