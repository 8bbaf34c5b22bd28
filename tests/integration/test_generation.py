"""Generate-and-capture in one pass: the verifier's greedy answers equal HF
transformers' token for token, and the hidden states of prompt + answer equal an
HF forward pass over that sequence, at every layer id (the pre-norm last one too)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import orjson
import pytest
from confluent_kafka import Producer

from hsx import models
from hsx.local.commands import STEADY_SESSION_TIMEOUT_MS, extract_command
from hsx.local.spawn import HsxService
from hsx.local.topics import fresh_topics
from hsx.reference import HFReference, max_relative_error
from tests.drain import drain
from hsx.runtime.settings import KafkaSettings
from hsx.schemas import DlqHeaders, ErrorClass
from tests.engine_helpers import Sample, reassemble

pytestmark = [pytest.mark.integration, pytest.mark.engine]

MAX_MODEL_LEN = 1024
# Prefill in chunks of this many tokens (interleaved with other requests' decode
# steps): output-token capture must hold under chunked prefill (vLLM's docs once
# said to turn it off for extraction; 0.32 on CPU needs no such restriction).
CHUNK = 64
SEEDS = [("a", 5), ("again", 5), ("other", 6)]
LAYERS = "0,2,4"
CHAT = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "what is a draft model?"},
        {"role": "assistant", "content": "a small model"}, {"role": "user", "content": "and a verifier?"}]
# A system prompt longer than a few cache blocks, so the final pass of a chat
# regenerated turn by turn finds its earlier turns in the prefix cache.
LONG_SYSTEM = " ".join(f"rule {i}: answer briefly and precisely." for i in range(12))
LONG_CHAT = [{"role": "system", "content": LONG_SYSTEM}, *CHAT[1:]]


@dataclass
class Run:
    model: Path
    tokenizer: object
    samples: dict[str, list[Sample]]
    dead: dict[str, DlqHeaders]
    reference: HFReference
    prefix_cache_hits: float


def _events(stop_token: int) -> list[dict[str, object]]:
    greedy = {"max_tokens": 12, "ignore_eos": True}
    return [
        {"request_id": "text-length", "prompt": "speculative decoding drafts tokens", "generation": greedy},
        {"request_id": "ids-length", "token_ids": list(range(10, 40)), "generation": greedy},
        {"request_id": "ids-chunked", "token_ids": list(range(10, 10 + 3 * CHUNK + 5)), "generation": greedy},
        {"request_id": "ids-stop", "token_ids": list(range(10, 40)),
         "generation": {"max_tokens": 12, "ignore_eos": True, "stop_token_ids": [stop_token]}},
        {"request_id": "chat-last", "messages": CHAT, "generation": {**greedy, "turns": "last"}},
        {"request_id": "chat-replace-last", "messages": [*CHAT[:3]], "generation": {**greedy, "turns": "last"}},
        # Bad generation requests: dead letters, each with its rule.
        {"request_id": "bad-zero", "prompt": "x", "generation": {"max_tokens": 0}},
        {"request_id": "bad-key", "prompt": "x", "generation": {"max_tokens": 3, "beam_width": 4}},
        {"request_id": "too-long", "token_ids": list(range(10, 40)), "generation": {"max_tokens": MAX_MODEL_LEN}},
        {"request_id": "chat-all", "messages": LONG_CHAT, "generation": greedy},
        # Sampling with a seed: the same answer every time, whatever else is in the batch.
        *({"request_id": f"seeded-{name}", "prompt": "a seeded answer", "generation": {
            "max_tokens": 12, "temperature": 1.0, "seed": seed, "ignore_eos": True}} for name, seed in SEEDS),
        # The final input token's hidden states only.
        {"request_id": "last-text", "prompt": "the last token is all we keep", "capture": "last"},
        {"request_id": "last-generated", "token_ids": list(range(10, 40)), "generation": greedy, "capture": "last"},
    ]


BAD = {"bad-zero": ErrorClass.INVALID_EVENT, "bad-key": ErrorClass.INVALID_EVENT,
       "too-long": ErrorClass.PROMPT_TOO_LONG}


@pytest.fixture(scope="module")
def run(kafka_bootstrap: str, tmp_path_factory: pytest.TempPathFactory) -> Run:
    from transformers import AutoTokenizer

    model = models.prepare(names=["tiny-llama"])["tiny-llama"]
    reference = HFReference(model)
    stop_token = reference.greedy(list(range(10, 40)), 12)[3]  # the 4th greedy token of "ids-stop"
    kafka = KafkaSettings(bootstrap=kafka_bootstrap)
    topics = fresh_topics(kafka, partitions=2)
    producer = Producer({"bootstrap.servers": kafka.bootstrap})
    events = _events(stop_token)
    for event in events:
        producer.produce(topics.prompts, key=str(event["request_id"]).encode(), value=orjson.dumps(event))
    assert producer.flush(30) == 0
    command = extract_command(kafka.bootstrap, topics, model, "--exit-when-idle", "8", "--max-model-len",
                              str(MAX_MODEL_LEN), "--max-num-batched-tokens", str(CHUNK), "--layers", LAYERS, group=f"g-{topics.prompts}",
                              session_timeout_ms=STEADY_SESSION_TIMEOUT_MS)
    hits = 0.0
    with HsxService("extract", command, tmp_path_factory.mktemp("generate")) as extractor:
        while extractor.exited() is None:  # vLLM's own counter, scraped while the extractor serves it
            value = extractor.metric("vllm:prefix_cache_hits_total", labelled=True)
            hits = max(hits, value if value == value else 0.0)
            time.sleep(0.5)
        assert extractor.exited() == 0, extractor.log_tail()
    samples = reassemble(drain(kafka, topics.blocks, expected=1, timeout=30, settle=3.0))
    dead = {r.key().decode(): DlqHeaders.from_kafka(r.headers())
            for r in drain(kafka, topics.prompts_dlq, len(BAD) + len(SEEDS))}
    return Run(model, AutoTokenizer.from_pretrained(model), samples, dead, reference, hits)


def _prompt_ids(run: Run, request_id: str) -> list[int]:
    event = next(e for e in _events(0) if e["request_id"] == request_id)
    if "prompt" in event:
        return run.tokenizer(event["prompt"])["input_ids"]  # type: ignore[operator,index]
    if "token_ids" in event:
        return list(event["token_ids"])  # type: ignore[arg-type]
    messages = event["messages"]
    keep = messages[:-1] if messages[-1]["role"] == "assistant" else messages  # type: ignore[index]
    text = run.tokenizer.apply_chat_template(keep, tokenize=False, add_generation_prompt=True)  # type: ignore[attr-defined]
    return run.tokenizer(text, add_special_tokens=False)["input_ids"]  # type: ignore[operator,index]


@pytest.mark.parametrize("request_id", ["text-length", "ids-length", "ids-chunked", "ids-stop", "chat-last",
                                        "chat-replace-last"])
def test_answers_are_hf_greedy_and_hidden_states_match(run: Run, request_id: str) -> None:
    (sample,) = run.samples[request_id]
    m = sample.manifest
    prompt = _prompt_ids(run, request_id)
    assert m.generation is not None
    stop = tuple(m.generation.params.stop_token_ids or ())
    expected = run.reference.greedy(prompt, m.generation.params.max_tokens, stop)
    answer = m.token_ids[len(prompt):] + [m.generation.final_token_id]
    assert m.token_ids[:len(prompt)] == prompt
    assert answer == expected
    (turn,) = m.generation.turns
    assert (turn.token_start, turn.token_end) == (len(prompt), len(prompt) + len(expected))
    assert turn.finish_reason == ("stop" if stop else "length")
    # The loss mask: the generated tokens that are inputs (the final one is not),
    # after any assistant turn the chat kept.
    assert m.loss_mask_spans is not None and m.loss_mask_spans[-1] == (len(prompt), len(m.token_ids))
    layers = [int(x) for x in LAYERS.split(",")]
    assert max_relative_error(sample.hidden_states, run.reference.hidden_states(m.token_ids, layers)) <= 1e-4


def test_a_stop_token_ends_the_answer_early(run: Run) -> None:
    (sample,) = run.samples["ids-stop"]
    assert sample.manifest.generation is not None
    assert sample.manifest.generation.final_token_id in (sample.manifest.generation.params.stop_token_ids or [])
    generated = len(sample.manifest.token_ids) - 30 + 1  # the answer, its final token included
    assert generated < sample.manifest.generation.params.max_tokens


def test_bad_generation_requests_are_dead_lettered(run: Run) -> None:
    assert {k: v.error_class for k, v in run.dead.items() if not k.startswith("seeded-")} == BAD
    assert "max_tokens" in run.dead["bad-zero"].error_message
    assert "beam_width" in run.dead["bad-key"].error_message
    assert f"1 x max_tokens {MAX_MODEL_LEN} do not fit max_model_len {MAX_MODEL_LEN}" in run.dead["too-long"].error_message
    assert not set(BAD) & set(run.samples)


def test_every_assistant_turn_is_regenerated_in_order(run: Run) -> None:
    """turns='all': each answer is HF's greedy continuation of everything before
    it (the verifier's earlier answers included), the template's own tokens in
    between; the final pass found the earlier turns in the prefix cache, and the
    hidden states of the whole sequence still equal a cold HF forward pass."""
    (sample,) = run.samples["chat-all"]
    m = sample.manifest
    assert m.generation is not None
    sequence = m.token_ids + [m.generation.final_token_id]
    first, second = m.generation.turns
    for turn in (first, second):
        assert sequence[turn.token_start:turn.token_end] == run.reference.greedy(sequence[:turn.token_start], 12)
        assert turn.finish_reason == "length"
    expected_prompt = run.tokenizer.apply_chat_template(LONG_CHAT[:2], tokenize=False, add_generation_prompt=True)  # type: ignore[attr-defined]
    assert sequence[:first.token_start] == run.tokenizer(expected_prompt, add_special_tokens=False)["input_ids"]  # type: ignore[operator,index]
    # Between the answers: the template's end of turn, the next user turn and the generation prompt.
    between = run.tokenizer.decode(sequence[first.token_end:second.token_start])  # type: ignore[attr-defined]
    assert LONG_CHAT[3]["content"] in between and not set(between.split()) & {"small", "model"}
    assert m.loss_mask_spans == [(first.token_start, first.token_end), (second.token_start, len(m.token_ids))]
    assert run.prefix_cache_hits > 0
    layers = [int(x) for x in LAYERS.split(",")]
    assert max_relative_error(sample.hidden_states, run.reference.hidden_states(m.token_ids, layers)) <= 1e-4


@pytest.mark.parametrize("request_id", ["last-text", "last-generated"])
def test_last_token_capture_keeps_one_row(run: Run, request_id: str) -> None:
    (sample,) = run.samples[request_id]
    m = sample.manifest
    assert m.capture == "last" and sample.hidden_states.shape == (1, 3, 128)
    assert len(m.blocks) == 1 and (m.blocks[0].token_start, m.blocks[0].token_end) == (m.num_tokens - 1, m.num_tokens)
    if request_id == "last-text":
        assert m.token_ids == _prompt_ids(run, request_id) and m.generation is None
    else:
        assert m.generation is not None and len(m.token_ids) == 30 + 12 - 1
    layers = [int(x) for x in LAYERS.split(",")]
    expected = run.reference.hidden_states(m.token_ids, layers)[-1:]
    assert max_relative_error(sample.hidden_states, expected) <= 1e-4


def test_a_seed_gives_the_same_answer(run: Run) -> None:
    from vllm.platforms import current_platform

    if current_platform.is_cpu():  # see Engine.sampling_problem: refused, and the greedy answers stay exact
        assert {run.dead[f"seeded-{name}"].error_class for name, _ in SEEDS} == {ErrorClass.ENGINE_REJECTED}
        assert "temperature > 0" in run.dead["seeded-a"].error_message
        return
    answers = {}
    for name, _ in SEEDS:
        (sample,) = run.samples[f"seeded-{name}"]
        assert sample.manifest.generation is not None
        answers[name] = sample.manifest.token_ids + [sample.manifest.generation.final_token_id]
    assert answers["a"] == answers["again"] != answers["other"]
