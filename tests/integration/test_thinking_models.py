"""A reasoning model's thinking switch end to end (issue 27): chats with
``chat_template_kwargs`` on tiny-qwen3 (a Qwen3 architecture whose chat template
has Qwen3's ``enable_thinking`` switch), extracted from a plain shell. The prompt
is the template's rendering with the event's variables, every answer is HF's
greedy continuation token for token (a thought included: nothing the verifier
generated is dropped), the answers are under the loss mask, and every layer is
within 1e-4 of HF's forward pass over the whole sequence."""

from __future__ import annotations

from pathlib import Path

import pytest

from hsx import models
from hsx.extractor.engine import default_layer_ids
from hsx.local.topics import fresh_topics
from hsx.reference import HFReference, max_relative_error
from hsx.runtime.settings import KafkaSettings
from tests.drain import drain
from tests.engine_helpers import reassemble
from tests.integration.test_extract_plain_shell import extract, plain_shell_env
from tests.reliability.harness import as_records, publish

pytestmark = pytest.mark.integration

ANSWER = {"max_tokens": 6, "ignore_eos": True}
QUESTION = [{"role": "user", "content": "Why is the sky blue?"}]
CHAT = [{"role": "user", "content": "hello there"}, {"role": "assistant", "content": "hi"},
        {"role": "user", "content": "what is 2 + 2?"}]
PROMPTS = [
    {"request_id": "thinking-on", "messages": QUESTION, "generation": ANSWER,
     "chat_template_kwargs": {"enable_thinking": True}},
    {"request_id": "thinking-default", "messages": QUESTION, "generation": ANSWER},
    {"request_id": "thinking-off", "messages": QUESTION, "generation": ANSWER,
     "chat_template_kwargs": {"enable_thinking": False}},
    {"request_id": "thinking-off-every-turn", "messages": CHAT, "generation": {**ANSWER, "turns": "all"},
     "chat_template_kwargs": {"enable_thinking": False}},
]
EMPTY_THOUGHT = "<think>\n\n</think>\n\n"


@pytest.mark.engine
def test_thinking_on_and_off_match_hf_greedy_and_hidden_states(kafka: KafkaSettings, tmp_path: Path) -> None:
    topics = fresh_topics(kafka, partitions=1)
    publish(kafka, topics.prompts, as_records(PROMPTS))
    status, log = extract(kafka, topics, tmp_path, "qwen3", "--max-model-len", "512",
                          env=plain_shell_env(kafka.bootstrap), model="tiny-qwen3")
    assert status == 0, log[-5000:]
    samples = reassemble(drain(kafka, topics.blocks, expected=1, timeout=30, settle=3.0))
    assert {k: len(v) for k, v in samples.items()} == {str(p["request_id"]): 1 for p in PROMPTS}

    from transformers import AutoTokenizer

    model_dir = models.prepare(names=["tiny-qwen3"])["tiny-qwen3"]
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    reference = HFReference(model_dir)
    layers = default_layer_ids(reference.num_layers)
    for prompt in PROMPTS:
        (sample,) = samples[str(prompt["request_id"])]
        m = sample.manifest
        assert m.generation is not None
        sequence = m.token_ids + [m.generation.final_token_id]
        for turn in m.generation.turns:  # each answer: HF's greedy continuation of everything before it
            assert sequence[turn.token_start:turn.token_end] == reference.greedy(
                sequence[:turn.token_start], turn.token_end - turn.token_start), (prompt["request_id"], turn)
            assert any(start <= turn.token_start and min(turn.token_end, m.num_tokens) <= end
                       for start, end in m.loss_mask_spans or []), (m.loss_mask_spans, turn)
        thinking_off = prompt.get("chat_template_kwargs") == {"enable_thinking": False}
        first = m.generation.turns[0].token_start
        if len(m.generation.turns) == 1:  # one answer: the prompt is the template's rendering, variables and all
            assert m.token_ids[:first] == tokenizer.apply_chat_template(
                prompt["messages"], add_generation_prompt=True, return_dict=False,
                **prompt.get("chat_template_kwargs", {}))
        before_answers = [tokenizer.decode(sequence[:turn.token_start]) for turn in m.generation.turns]
        assert all(text.endswith(EMPTY_THOUGHT) == thinking_off for text in before_answers), before_answers
        assert m.layer_ids == layers
        assert max_relative_error(sample.hidden_states, reference.hidden_states(m.token_ids, layers)) <= 1e-4
