"""Model-level prompt checks with the tiny model's real tokenizer."""

from __future__ import annotations

import base64
import copy

import orjson
import pytest

from hsx import models
from hsx.extractor.prompts import PromptPreparer, PromptRejected
from hsx.models.tiny_qwen3 import QWEN3_CHAT_TEMPLATE
from hsx.schemas import PromptEvent


@pytest.fixture(scope="module")
def tokenizer():  # type: ignore[no-untyped-def]
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(models.prepare(names=["tiny-llama"])["tiny-llama"])


def event(**fields: object) -> PromptEvent:
    return PromptEvent.model_validate_json(orjson.dumps({"request_id": "r", **fields}))


CHAT = [{"role": "user", "content": "hello there"}, {"role": "assistant", "content": "hi"},
        {"role": "user", "content": "bye"}, {"role": "assistant", "content": "see you"}]


def test_text_is_tokenized_like_the_tokenizer(tokenizer) -> None:  # type: ignore[no-untyped-def]
    prepared = PromptPreparer(tokenizer, len(tokenizer), 64).prepare(event(prompt="the quick brown fox"))
    assert prepared.token_ids == tokenizer("the quick brown fox")["input_ids"] and prepared.loss_mask_spans is None


def test_chat_mask_spans_are_the_assistant_turns(tokenizer) -> None:  # type: ignore[no-untyped-def]
    prepared = PromptPreparer(tokenizer, len(tokenizer), 256).prepare(event(messages=CHAT))
    assert prepared.token_ids == tokenizer.apply_chat_template(CHAT, tokenize=True, return_dict=False)
    decoded = [tokenizer.decode(prepared.token_ids[s:e]) for s, e in prepared.loss_mask_spans or []]
    assert decoded == ["hi<|im_end|>\n", "see you<|im_end|>\n"]


@pytest.mark.parametrize(
    "fields, max_len, error_class, fragment",
    [
        ({"token_ids": [1, 2, 5000]}, 64, "token_out_of_vocabulary", "token_ids.2 = 5000"),
        ({"token_ids": [1, 5000, 6000]}, 64, "token_out_of_vocabulary", "(2 such ids)"),
        ({"token_ids": list(range(64))}, 64, "prompt_too_long", "64 tokens; at most 63"),
        ({"prompt": "word " * 200}, 64, "prompt_too_long", "at most 63"),
    ],
)
def test_model_level_rejections(tokenizer, fields: dict, max_len: int, error_class: str, fragment: str) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(PromptRejected) as info:
        PromptPreparer(tokenizer, len(tokenizer), max_len).prepare(event(**fields))
    assert info.value.error_class == error_class and fragment in str(info.value)


@pytest.mark.parametrize("fields", [
    {"prompt": "x" * 900_000},
    {"messages": [{"role": "user", "content": "y " * 400_000}, {"role": "assistant", "content": "ok"}]},
    {"messages": [{"role": "user", "content": "z" * 900_000}], "generation": {"max_tokens": 4}},
])
def test_text_too_long_for_any_tokenization_is_rejected_before_tokenizing(tokenizer, fields: dict) -> None:  # type: ignore[no-untyped-def]
    # Megabytes took the tokenizer seconds (and the mask spans a quadratic pass)
    # before the rejection; no token covers more characters than the longest in the vocabulary.
    class Untouchable:
        def __init__(self, inner: object) -> None:
            self.inner = inner

        def __getattr__(self, name: str) -> object:
            return getattr(self.inner, name)

        def __call__(self, *args: object, **kwargs: object) -> object:
            raise AssertionError("the tokenizer was called")

    preparer = PromptPreparer(Untouchable(tokenizer), len(tokenizer), 4096)
    with pytest.raises(PromptRejected) as info:
        preparer.prepare(event(**fields))
    longest = max(len(t) for t in tokenizer.get_vocab())
    assert info.value.error_class == "prompt_too_long"
    assert f"more than max_model_len 4096 tokens can hold (at most {4096 * longest * 4:,} characters" in str(info.value)


def test_template_that_raises_is_a_clear_rejection(tokenizer) -> None:  # type: ignore[no-untyped-def]
    strict = copy.deepcopy(tokenizer)
    strict.chat_template = "{% for m in messages %}{% if m.role == 'tool' %}{{ raise_exception('no tools here') }}{% endif %}{{ m.content }}{% endfor %}"
    with pytest.raises(PromptRejected) as info:
        PromptPreparer(strict, len(strict), 64).prepare(event(messages=[{"role": "tool", "content": "x"}]))
    assert info.value.error_class == "chat_template_error" and "no tools here" in str(info.value)


def test_template_without_stable_prefixes_is_refused(tokenizer) -> None:  # type: ignore[no-untyped-def]
    odd = copy.deepcopy(tokenizer)
    odd.chat_template = "{{ messages|length }}:{% for m in messages %}{{ m.content }} {% endfor %}"
    with pytest.raises(PromptRejected) as info:
        PromptPreparer(odd, len(odd), 64).prepare(event(messages=CHAT))
    assert info.value.error_class == "chat_template_unsupported"


def test_turn_by_turn_regeneration_places_each_answer_after_its_template_piece(tokenizer) -> None:  # type: ignore[no-untyped-def]
    from hsx.extractor.regeneration import tokens_after_answer

    preparer = PromptPreparer(tokenizer, len(tokenizer), 512)
    prepared = preparer.prepare(event(messages=CHAT, generation={"max_tokens": 4}))
    first_prompt = tokenizer.apply_chat_template(CHAT[:1], tokenize=False, add_generation_prompt=True)
    assert prepared.token_ids == tokenizer(first_prompt, add_special_tokens=False)["input_ids"]
    (piece,) = prepared.followups  # two answers: one piece between them
    between = tokenizer.decode(piece)
    assert "bye" in between and "hi" not in between and between.endswith("assistant\n")
    assert prepared.loss_mask_spans == []  # the given answers are replaced, not learned from
    # An answer that generated the end-of-turn token itself is not closed twice.
    assert tokens_after_answer([5, piece[0]], piece) == piece[1:] and tokens_after_answer([5, 6], piece) == piece


def test_a_message_holding_the_old_fixed_marker_does_not_misplace_answers(tokenizer) -> None:  # type: ignore[no-untyped-def]
    # The marker used to be fixed: a user turn quoting it was found before the
    # first answer's own, and the pieces were cut at the wrong places.
    marker = "\u2063HSX-ANSWER-0\u2063"
    chat = [{"role": "user", "content": f"say {marker} please"}, *CHAT[1:]]
    preparer = PromptPreparer(tokenizer, len(tokenizer), 512)
    prepared = preparer.prepare(event(messages=chat, generation={"max_tokens": 4}))
    first_prompt = tokenizer.apply_chat_template(chat[:1], tokenize=False, add_generation_prompt=True)
    assert prepared.token_ids == tokenizer(first_prompt, add_special_tokens=False)["input_ids"]
    (piece,) = prepared.followups
    assert "bye" in tokenizer.decode(piece) and "please" not in tokenizer.decode(piece)


def test_generation_must_fit_with_every_answer(tokenizer) -> None:  # type: ignore[no-untyped-def]
    preparer = PromptPreparer(tokenizer, len(tokenizer), 64)
    with pytest.raises(PromptRejected, match=r"2 x max_tokens 30 do not fit max_model_len 64") as caught:
        preparer.prepare(event(messages=CHAT, generation={"max_tokens": 30}))
    assert caught.value.error_class == "prompt_too_long"


@pytest.mark.parametrize("turns", ["last", "all"])
def test_chat_template_kwargs_reach_the_template(tokenizer, turns: str) -> None:  # type: ignore[no-untyped-def]
    """An event's ``chat_template_kwargs`` are the template's variables, for one
    answer and for answers regenerated turn by turn; without them the template's
    default holds."""
    thinking = copy.deepcopy(tokenizer)
    thinking.chat_template = QWEN3_CHAT_TEMPLATE  # tiny-qwen3's: Qwen3's thinking switch on ChatML
    preparer = PromptPreparer(thinking, len(thinking), 512)
    generation = {"max_tokens": 4, "turns": turns}

    def prompt(**variables: object) -> str:
        prepared = preparer.prepare(event(messages=CHAT, generation=generation, **variables))
        return thinking.decode(prepared.token_ids)  # the prompt of the first (or only) answer

    off = prompt(chat_template_kwargs={"enable_thinking": False})
    assert off.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n"), off
    for on in (prompt(chat_template_kwargs={"enable_thinking": True}), prompt()):
        assert on.endswith("<|im_start|>assistant\n"), on


def test_text_parts_render_as_their_text(tokenizer) -> None:  # type: ignore[no-untyped-def]
    parts = [{"role": "user", "content": [{"type": "text", "text": "hello"}, {"type": "text", "text": "there"}]}]
    preparer = PromptPreparer(tokenizer, len(tokenizer), 256)
    assert preparer.prepare(event(messages=parts)).token_ids == preparer.prepare(
        event(messages=[{"role": "user", "content": "hello\nthere"}])).token_ids


def test_an_image_prompt_is_refused_naming_the_part(tokenizer) -> None:  # type: ignore[no-untyped-def]
    png = "data:image/png;base64," + base64.b64encode(b"\x89PNG\r\n\x1a\n" + bytes(8)).decode()
    chat = [{"role": "user", "content": "hi"},
            {"role": "user", "content": [{"type": "text", "text": "what is it?"}, {"type": "image_url", "image_url": {"url": png}}]}]
    with pytest.raises(PromptRejected) as info:
        PromptPreparer(tokenizer, len(tokenizer), 256).prepare(event(messages=chat))
    assert info.value.error_class == "images_unsupported" and "messages.1.content part 1 is an image" in str(info.value)
