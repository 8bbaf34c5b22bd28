"""Turn-by-turn regeneration of a chat (``turns: "all"``): the template pieces
between the verifier's answers, as token ids.

The chat is rendered once with a sentinel in place of every answer; the text
between sentinels is tokenized piece by piece. The engine then sees piece 0,
answer 0 as generated, piece 1, answer 1, ... so the captured sequence is made of
the template's tokens and the generated ids, and generated text is never
re-tokenized.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable
from dataclasses import dataclass

from hsx.schemas import Message

_SENTINEL = "\u2063HSX-ANSWER-{nonce}-{k}\u2063"
"""Invisible separators around a marker no chat contains: its nonce is drawn
per chat, so a message cannot hold it by accident or on purpose (a fixed marker
in a user's text would be found first and misplace the answers)."""


def _sentinels(messages: list[Message], count: int) -> list[str]:
    """``count`` markers, none of which occurs in any message."""
    while True:
        nonce = secrets.token_hex(8)
        if not any(nonce in m.text for m in messages):
            return [_SENTINEL.format(nonce=nonce, k=k) for k in range(count)]


@dataclass(frozen=True)
class RegenerationPlan:
    pieces: list[list[int]]
    """``pieces[0]`` is the prompt of the first answer; ``pieces[k]`` the template
    tokens between answer ``k-1`` and answer ``k`` (the end of the previous turn,
    the next user turns, the generation prompt)."""


def answer_positions(messages: list[Message]) -> list[int]:
    """The indices of the assistant turns, plus ``len(messages)`` when the chat
    ends with another role (one more answer at the end)."""
    positions = [i for i, m in enumerate(messages) if m.role == "assistant"]
    if messages[-1].role != "assistant":
        positions.append(len(messages))
    return positions


def plan(messages: list[Message], render: Callable[[list[dict[str, str]], bool], str],
         tokenize: Callable[[str], list[int]]) -> RegenerationPlan | None:
    """The pieces, or ``None`` when the template does not keep the sentinels in
    order (it rewrites assistant content), so the answers cannot be placed.
    ``render(chat, add_generation_prompt)``."""
    positions = answer_positions(messages)
    sentinels = _sentinels(messages, len(positions))
    dicts = [{"role": m.role, "content": m.text} for m in messages]
    for k, position in enumerate(positions):
        answer = {"role": "assistant", "content": sentinels[k]}
        if position == len(messages):
            dicts.append(answer)
        else:
            dicts[position] = answer
    text = render(dicts, False)
    pieces: list[list[int]] = []
    start = 0
    for k, position in enumerate(positions):
        at = text.find(sentinels[k], start)
        if at < 0:
            return None
        # The answer's prompt ends as the template's generation prompt ends it,
        # which may pre-fill more than a past turn shows (Qwen3's empty thought).
        prompted = render(dicts[:position], True)
        pieces.append(tokenize(prompted[start:] if prompted.startswith(text[:at]) else text[start:at]))
        start = at + len(sentinels[k])
    return RegenerationPlan(pieces)


def tokens_after_answer(answer: list[int], piece: list[int]) -> list[int]:
    """The tokens that follow an answer: ``piece``, less the end-of-turn token the
    answer already generated itself (the template would close the turn again)."""
    if answer and piece and answer[-1] == piece[0]:
        return piece[1:]
    return piece
