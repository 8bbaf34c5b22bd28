"""Turning a validated prompt event into the exact token ids the engine sees,
and the loss mask of a chat.

The extractor tokenizes itself (vLLM receives token ids), so the ids in the
manifest are by construction those of the model's tokenizer / chat template, and
the loss mask lines up with them.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from hsx.extractor import regeneration
from hsx.runtime.errors import InvalidInput
from hsx.schemas import ErrorClass, Generation, Message, PromptEvent


class PromptRejected(InvalidInput):
    """A prompt that only the model can judge as bad; goes to the DLQ."""


@dataclass(frozen=True)
class PreparedPrompt:
    token_ids: list[int]
    loss_mask_spans: list[tuple[int, int]] | None
    """Token ranges ``[start, end)`` of the assistant turns (chats only)."""
    followups: list[list[int]] = field(default_factory=list)
    """Turn-by-turn regeneration: the template tokens after each answer but the
    last (see :mod:`hsx.extractor.regeneration`); empty for one answer or none."""


NORMALIZER_SLACK = 4
"""How many characters a tokenizer's normalizer might fold into one (composing
accents, say) before a token covers them: the text-length bound allows that many."""


class PromptPreparer:
    """Tokenizes text, renders chats with the model's chat template, and enforces
    what the model allows (vocabulary, context length)."""

    def __init__(self, tokenizer: Any, vocab_size: int, max_model_len: int) -> None:
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._max_model_len = max_model_len
        longest = max((len(token) for token in tokenizer.get_vocab()), default=1)
        self._max_chars = max_model_len * longest * NORMALIZER_SLACK
        """Text longer than this cannot fit the context: no token covers more
        than ``longest`` characters. Checked before tokenizing, which takes
        seconds for megabytes."""

    def prepare(self, event: PromptEvent) -> PreparedPrompt:
        """Raises :class:`PromptRejected` with a rule name and a reason."""
        if event.images:
            message, part, _ = event.images[0]
            raise PromptRejected(ErrorClass.IMAGES_UNSUPPORTED,
                                 f"messages.{message}.content part {part} is an image: image prompts do not reach the "
                                 f"engine yet (hsx passes token ids only); {len(event.images)} image(s) in the chat")
        if event.prompt is not None:
            prepared = PreparedPrompt(self._tokenize(event.prompt)["input_ids"], None)
        elif event.token_ids is not None:
            prepared = PreparedPrompt(list(event.token_ids), None)
            self._check_vocabulary(prepared.token_ids)
        elif _regenerates_turns(event):
            assert event.messages is not None
            prepared = self._regeneration(event.messages, event.chat_template_kwargs or {})
        else:
            assert event.messages is not None
            prepared = self._chat(_turns_to_keep(event.messages, event.generation), event.chat_template_kwargs or {},
                                  answer=event.generation is not None)
        if not prepared.token_ids:
            raise PromptRejected(ErrorClass.EMPTY_PROMPT, "the prompt is empty after tokenization")
        self._check_room(prepared, event.generation)
        return prepared

    def _regeneration(self, messages: list[Message], variables: dict[str, Any]) -> PreparedPrompt:
        plan = regeneration.plan(messages, lambda dicts, prompt: self._render(dicts, variables, prompt), self._template_ids)
        if plan is None:
            raise PromptRejected(ErrorClass.CHAT_TEMPLATE_UNSUPPORTED,
                                 "the chat template rewrites assistant content, so answers cannot be placed turn by turn")
        return PreparedPrompt(plan.pieces[0], [], plan.pieces[1:])

    def _template_ids(self, text: str) -> list[int]:
        return self._tokenize(text, add_special_tokens=False)["input_ids"]

    def _tokenize(self, text: str, **options: Any) -> Any:
        """The tokenizer's encoding of ``text``; :class:`PromptRejected` at once
        for text too long to fit the context in any tokenization."""
        if len(text) > self._max_chars:
            raise PromptRejected(ErrorClass.PROMPT_TOO_LONG,
                                 f"{len(text):,} characters: more than max_model_len {self._max_model_len} tokens "
                                 f"can hold (at most {self._max_chars:,} characters with this tokenizer)")
        return self._tokenizer(text, **options)

    def _check_room(self, prepared: PreparedPrompt, generation: Generation | None) -> None:
        """The prompt plus every token the engine may add must fit the context: a
        prompt that cannot take all its answers is rejected before generating
        anything, so every sample's answers obey their own ``max_tokens``."""
        prompt_tokens = len(prepared.token_ids) + sum(len(piece) for piece in prepared.followups)
        if generation is None:  # max_tokens=1: the prompt plus one sampled token
            if prompt_tokens > self._max_model_len - 1:
                raise PromptRejected(ErrorClass.PROMPT_TOO_LONG,
                                     f"{prompt_tokens} tokens; at most {self._max_model_len - 1} fit max_model_len")
        elif prompt_tokens + generation.max_tokens * (1 + len(prepared.followups)) > self._max_model_len:
            answers = 1 + len(prepared.followups)
            raise PromptRejected(ErrorClass.PROMPT_TOO_LONG,
                                 f"{prompt_tokens} prompt tokens + {answers} x max_tokens {generation.max_tokens} do not "
                                 f"fit max_model_len {self._max_model_len}")

    def _check_vocabulary(self, token_ids: list[int]) -> None:
        bad = [(i, t) for i, t in enumerate(token_ids) if t >= self._vocab_size]
        if bad:
            index, token = bad[0]
            raise PromptRejected(
                ErrorClass.TOKEN_OUT_OF_VOCABULARY,
                f"token_ids.{index} = {token} is outside the vocabulary of {self._vocab_size}"
                + (f" ({len(bad)} such ids)" if len(bad) > 1 else ""),
            )

    def _render(self, messages: list[dict[str, str]], variables: dict[str, Any],
                add_generation_prompt: bool = False) -> str:
        """The chat as text; ``variables``: the event's ``chat_template_kwargs``."""
        try:
            return self._tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=add_generation_prompt, **variables
            )
        except Exception as exc:  # jinja2 errors, raise_exception() in templates, missing template
            raise PromptRejected(ErrorClass.CHAT_TEMPLATE_ERROR, f"the chat template rejected the messages: {exc}") from exc

    def _chat(self, messages: list[Message], variables: dict[str, Any], answer: bool = False) -> PreparedPrompt:
        """Render a chat; with ``answer``, ending in the generation prompt the
        verifier answers after. The loss mask marks the given assistant turns."""
        dicts = [{"role": m.role, "content": m.text} for m in messages]
        text = self._render(dicts, variables, add_generation_prompt=answer)
        char_spans = []
        for i, message in enumerate(messages):
            if message.role != "assistant":
                continue
            # The assistant turn is what rendering it adds after the generation
            # prompt of the conversation so far. This needs a template whose
            # renderings of prefixes are prefixes of the full rendering.
            history = self._render(dicts[:i], variables) if i else ""
            upto = self._render(dicts[: i + 1], variables)
            if not (upto.startswith(history) and text.startswith(upto)):
                raise PromptRejected(
                    ErrorClass.CHAT_TEMPLATE_UNSUPPORTED,
                    "the chat template does not render conversation prefixes as prefixes, "
                    f"so the assistant turn {i} cannot be located",
                )
            # After as much of the generation prompt as the turn repeats: a prompt may
            # pre-fill more (Qwen3's empty thought, thinking off) than a past turn shows.
            prompted = self._render(dicts[:i], variables, add_generation_prompt=True) if i else ""
            char_spans.append((max(len(history), len(os.path.commonprefix([prompted, upto]))), len(upto)))
        encoding = self._tokenize(text, add_special_tokens=False, return_offsets_mapping=True)
        spans = _token_spans(encoding["offset_mapping"], char_spans)
        return PreparedPrompt(encoding["input_ids"], spans)


def _token_spans(offsets: list[tuple[int, int]], char_spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Token ranges of the tokens overlapping any character span. Both lists are
    in text order, so one pass over each (a long chat has many of both)."""
    spans: list[tuple[int, int]] = []
    next_span = 0
    for index, (start, end) in enumerate(offsets):
        while next_span < len(char_spans) and char_spans[next_span][1] <= start:
            next_span += 1  # spans that end before this token can overlap no later one
        if next_span == len(char_spans):
            break
        # The first span not ended before the token is the only one it can overlap
        # without overlapping this one too (the spans are disjoint and in order).
        if not (start < char_spans[next_span][1] and end > char_spans[next_span][0]):
            continue
        if spans and spans[-1][1] == index:
            spans[-1] = (spans[-1][0], index + 1)
        else:
            spans.append((index, index + 1))
    return spans


def _regenerates_turns(event: PromptEvent) -> bool:
    """A chat whose assistant turns are all regenerated, more than one answer."""
    return (event.messages is not None and event.generation is not None and event.generation.turns == "all"
            and len(regeneration.answer_positions(event.messages)) > 1)


def _turns_to_keep(messages: list[Message], generation: Generation | None) -> list[Message]:
    """The turns the verifier answers after (one answer, or none): without
    generation, all of them; with it, all but a final assistant turn, which the
    verifier's answer replaces."""
    if generation is None or messages[-1].role != "assistant":
        return messages
    return messages[:-1]
