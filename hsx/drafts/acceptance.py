"""A draft's acceptance in vLLM: the same prompts decoded greedily by the
verifier alone and with the draft proposing tokens, side by side.

The counts are vLLM's own speculative-decoding counters
(``vllm:spec_decode_num_drafts``, ``..._num_draft_tokens``,
``..._num_accepted_tokens``, ``..._num_accepted_tokens_per_pos``), never a count
of ours; mean acceptance length is ``1 + accepted / drafts`` as vLLM and
speculators report it. Greedy outputs must be the same with and without the
draft (speculative decoding never changes them): the prompts where they are not
are listed.
"""

from __future__ import annotations

import gc
import logging
import time
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import orjson

from hsx.extractor.engine import EngineOptions
from hsx.extractor.model_config import text_config
from hsx.extractor.prompts import PromptPreparer, PromptRejected
from hsx.producer.publisher import InvalidLine, Mapping, parse_line
from hsx.producer.sources import SourceLine
from hsx.schemas import Generation

log = logging.getLogger(__name__)

DRAFTS = "vllm:spec_decode_num_drafts"
DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens"
ACCEPTED = "vllm:spec_decode_num_accepted_tokens"
ACCEPTED_PER_POSITION = "vllm:spec_decode_num_accepted_tokens_per_pos"


@dataclass(frozen=True)
class EvalPrompt:
    request_id: str
    token_ids: list[int]
    """What the engine is given: the text, or the chat up to its last user turn
    rendered with the generation prompt (as ``hsx run --generate`` renders it)."""


@dataclass(frozen=True)
class EvalSettings:
    model: str
    draft: str
    num_speculative_tokens: int | None = None
    """Tokens the draft proposes per step; None: what its checkpoint says."""
    max_tokens: int = 128
    dtype: str = "auto"
    max_model_len: int = 4096
    max_num_seqs: int | None = None
    enforce_eager: bool = False
    engine_args: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Decoded:
    """One engine's greedy answers and how long it took."""

    outputs: dict[str, list[int]]
    seconds: float
    counters: dict[str, Any]
    """vLLM's speculative-decoding counters (empty without a draft)."""

    @property
    def tokens(self) -> int:
        return sum(len(ids) for ids in self.outputs.values())


@dataclass(frozen=True)
class AcceptanceReport:
    """What ``hsx eval-draft`` reports (and writes with ``--json``)."""

    model: str
    draft: str
    speculative_config: dict[str, Any]
    """What vLLM was given: the method and its options as vLLM reads them from
    the checkpoint (``eagle3``, ``dflash``, ``eagle3`` with ``parallel_drafting``
    for P-EAGLE), the tokens per step."""
    prompts: int
    invalid_rows: int
    num_speculative_tokens: int
    max_tokens: int
    drafts: int
    draft_tokens: int
    accepted_tokens: int
    acceptance_length: float
    """Mean tokens per verifier step with the draft: ``1 + accepted / drafts``."""
    per_position: list[float]
    """Of all drafts, the share whose token at position i (0-based) was accepted."""
    generated_tokens_with_draft: int
    generated_tokens_without_draft: int
    tokens_per_s_with_draft: float
    tokens_per_s_without_draft: float
    outputs_identical: bool
    differing_prompts: list[str]
    """Request ids whose greedy output changed with the draft (it must not)."""

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def describe(self) -> str:
        positions = " / ".join(f"{rate:.3f}" for rate in self.per_position)
        speedup = self.tokens_per_s_with_draft / self.tokens_per_s_without_draft if self.tokens_per_s_without_draft else 0
        identical = ("identical on every prompt" if self.outputs_identical else
                     f"DIFFERENT on {len(self.differing_prompts)} prompts: {', '.join(self.differing_prompts[:10])}")
        method = ", ".join(f"{k} {v}" for k, v in self.speculative_config.items()
                           if k not in ("model", "num_speculative_tokens"))
        return (f"{self.prompts} prompts, {self.num_speculative_tokens} speculative tokens ({method}), greedy, "
                f"up to {self.max_tokens} tokens each\n"
                f"mean acceptance length {self.acceptance_length:.3f} ({self.accepted_tokens} of "
                f"{self.draft_tokens} drafted tokens accepted in {self.drafts} drafts)\n"
                f"acceptance per position {positions}\n"
                f"tokens/s {self.tokens_per_s_with_draft:.1f} with the draft, {self.tokens_per_s_without_draft:.1f} "
                f"without ({speedup:.2f}x)\n"
                f"greedy outputs with and without the draft: {identical}")


def prepare_prompts(lines: Iterable[SourceLine], mapping: Mapping, model: str, max_model_len: int,
                    max_tokens: int) -> tuple[list[EvalPrompt], list[str]]:
    """Every row as the token ids the verifier answers, and one line per row
    that cannot be (an invalid event, a prompt too long for ``max_tokens`` more).
    A row's own ``generation`` is replaced: every prompt is decoded greedily for
    ``max_tokens`` (a chat's final assistant turn, if any, is what gets answered)."""
    from transformers import AutoTokenizer

    preparer = PromptPreparer(AutoTokenizer.from_pretrained(model), text_config(model).vocab_size, max_model_len)
    greedy = Generation(max_tokens=max_tokens, turns="last")
    prompts, invalid = [], []
    for line in lines:
        try:
            event = parse_line(line, mapping).model_copy(update={"generation": greedy})
            prompts.append(EvalPrompt(event.request_id, preparer.prepare(event).token_ids))
        except InvalidLine as exc:
            invalid.append(str(exc))
        except PromptRejected as exc:
            invalid.append(f"{line.source}:{line.line_no}: {exc.error_class.value}: {exc.reason}")
    return prompts, invalid


def evaluate(settings: EvalSettings, prompts: Sequence[EvalPrompt], invalid_rows: int = 0) -> AcceptanceReport:
    """Decode ``prompts`` without the draft, then with it (one engine at a time),
    and compare."""
    speculative = speculative_config(settings.draft, settings.num_speculative_tokens)
    alone = decode(settings, prompts, None)
    drafted = decode(settings, prompts, speculative)
    counters = drafted.counters
    drafts = int(counters.get(DRAFTS, 0))
    accepted = int(counters.get(ACCEPTED, 0))
    per_position = [count / drafts if drafts else 0.0 for count in counters.get(ACCEPTED_PER_POSITION, [])]
    differing = [p.request_id for p in prompts if alone.outputs[p.request_id] != drafted.outputs[p.request_id]]
    return AcceptanceReport(
        model=settings.model, draft=settings.draft, speculative_config=speculative, prompts=len(prompts),
        invalid_rows=invalid_rows, num_speculative_tokens=speculative["num_speculative_tokens"],
        max_tokens=settings.max_tokens,
        drafts=drafts, draft_tokens=int(counters.get(DRAFT_TOKENS, 0)), accepted_tokens=accepted,
        acceptance_length=1 + accepted / drafts if drafts else 1.0, per_position=per_position,
        generated_tokens_with_draft=drafted.tokens, generated_tokens_without_draft=alone.tokens,
        tokens_per_s_with_draft=drafted.tokens / drafted.seconds,
        tokens_per_s_without_draft=alone.tokens / alone.seconds,
        outputs_identical=not differing, differing_prompts=differing)


def speculative_config(draft: str, num_speculative_tokens: int | None = None) -> dict[str, Any]:
    """vLLM's speculative config for the checkpoint ``draft``, as vLLM itself
    reads it from ``config.json`` (``vllm serve DRAFT`` would): the method for
    its type and the tokens per step it was trained for, unless
    ``num_speculative_tokens`` says otherwise."""
    from vllm.transformers_utils.configs.speculators.base import SpeculatorsConfig

    config = SpeculatorsConfig.build_vllm_speculative_config(orjson.loads((Path(draft) / "config.json").read_bytes()))
    if num_speculative_tokens is not None:
        config["num_speculative_tokens"] = num_speculative_tokens
    return {**config, "model": str(Path(draft))}


def decode(settings: EvalSettings, prompts: Sequence[EvalPrompt], speculative: dict[str, Any] | None) -> Decoded:
    """Greedy answers of one engine (the verifier, with the draft ``speculative``
    configures or without one), shut down before returning so that the next one
    has the memory."""
    from vllm import SamplingParams, TokensPrompt

    llm = _start(settings, speculative)
    try:
        started = time.monotonic()
        results = llm.generate([TokensPrompt(prompt_token_ids=p.token_ids) for p in prompts],
                               SamplingParams(max_tokens=settings.max_tokens, temperature=0.0), use_tqdm=False)
        seconds = time.monotonic() - started
        counters = _spec_counters(llm.get_metrics()) if speculative else {}
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()
    outputs = {p.request_id: list(r.outputs[0].token_ids) for p, r in zip(prompts, results)}
    log.info("%s the draft: %d tokens in %.1fs", "with" if speculative else "without",
             sum(map(len, outputs.values())), seconds)
    return Decoded(outputs, seconds, counters)


def _start(settings: EvalSettings, speculative: dict[str, Any] | None) -> Any:
    """An ``LLM`` for the verifier, with the CPU defaults hsx's extractor uses."""
    from vllm import LLM

    from hsx.extractor.cpu_defaults import apply_cpu_defaults
    from hsx.extractor.cpu_start import worker_in_engine_core

    options = EngineOptions(model=settings.model, layer_ids=[], dtype=settings.dtype,
                            max_model_len=settings.max_model_len, max_num_seqs=settings.max_num_seqs,
                            enforce_eager=settings.enforce_eager, engine_args=settings.engine_args)
    kwargs: dict[str, Any] = dict(model=settings.model, dtype=settings.dtype, max_model_len=settings.max_model_len,
                                  enforce_eager=settings.enforce_eager, disable_log_stats=False, seed=0)
    if settings.max_num_seqs is not None:
        kwargs["max_num_seqs"] = settings.max_num_seqs
    if speculative:
        kwargs["speculative_config"] = speculative
    kwargs.update(settings.engine_args)
    chosen = SimpleNamespace()  # worker_in_engine_core picks the executor on CPU
    with worker_in_engine_core(apply_cpu_defaults(options), chosen):
        return LLM(**kwargs, **vars(chosen))


def _spec_counters(metrics: Iterable[Any]) -> dict[str, Any]:
    """vLLM's speculative-decoding counters by name (summed over engines)."""
    counters: dict[str, Any] = {}
    for metric in metrics:
        if metric.name in (DRAFTS, DRAFT_TOKENS, ACCEPTED):
            counters[metric.name] = counters.get(metric.name, 0) + metric.value
        elif metric.name == ACCEPTED_PER_POSITION:
            previous = counters.get(metric.name, [0] * len(metric.values))
            counters[metric.name] = [a + b for a, b in zip(previous, metric.values)]
    return counters
