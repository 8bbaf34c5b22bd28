"""PromptEvent is the one gate every prompt passes: each rejection must name the
field and the rule it broke."""

from __future__ import annotations

import base64

import orjson
import pytest
from pydantic import ValidationError

from hsx.schemas import Message, PromptEvent, PromptLimits, SourceRef, format_validation_error, sample_id
from hsx.schemas.connector import RequestParams

SMALL = PromptLimits(
    max_event_bytes=4096,
    max_prompt_chars=100,
    max_token_ids=10,
    max_messages=3,
    max_message_chars=50,
    max_metadata_bytes=200,
    max_metadata_depth=3,
    max_template_kwargs_bytes=100,
    max_image_bytes=100,
    max_images=2,
)


def ev(**fields: object) -> bytes:
    return orjson.dumps({"request_id": "r-1", **fields})


CHAT = [{"role": "user", "content": "Hi"}]
PNG = b"\x89PNG\r\n\x1a\n" + bytes(40)


def image(url: str) -> dict[str, object]:
    return {"type": "image_url", "image_url": {"url": url}}


def data_uri(data: bytes = PNG, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64,{base64.b64encode(data).decode()}"


def with_image(url: str, role: str = "user") -> list[dict[str, object]]:
    return [{"role": role, "content": [{"type": "text", "text": "What is this?"}, image(url)]}]


def deep(levels: int) -> dict:
    value: dict = {"leaf": 1}
    for _ in range(levels):
        value = {"n": value}
    return value


# (case id, raw event, expected location, fragment of the message or error type)
INVALID = [
    ("bad-json", b"{", "(event)", "json_invalid"),
    ("json-array", b"[]", "(event)", "model_type"),
    ("json-string", b'"hello"', "(event)", "model_type"),
    ("non-utf8", b'{"request_id":"a","prompt":"\xff\xfe"}', "(event)", "json_invalid"),
    ("deep-nesting-json", b'{"request_id":"a","prompt":"x","metadata":{"a":' + b"[" * 300 + b"]" * 300 + b"}}", "(event)", "json_invalid"),
    ("missing-request-id", orjson.dumps({"prompt": "hi"}), "request_id", "missing"),
    ("request-id-too-long", orjson.dumps({"request_id": "a" * 1025, "prompt": "hi"}), "request_id",
     "string_too_long"),
    ("request-id-empty", orjson.dumps({"request_id": "", "prompt": "hi"}), "request_id", "string_too_short"),
    ("request-id-int", orjson.dumps({"request_id": 5, "prompt": "hi"}), "request_id", "string_type"),
    ("request-id-null", orjson.dumps({"request_id": None, "prompt": "hi"}), "request_id", "string_type"),
    ("unknown-field", ev(prompt="hi", temperature=0.5), "temperature", "extra_forbidden"),
    ("no-input", ev(), "(event)", "exactly one of 'prompt', 'token_ids', 'messages'"),
    ("null-input", ev(prompt=None), "(event)", "got: none"),
    ("two-inputs", ev(prompt="hi", token_ids=[1]), "(event)", "got: prompt, token_ids"),
    ("empty-prompt", ev(prompt=""), "prompt", "must not be empty"),
    ("blank-prompt", ev(prompt=" \n\t"), "prompt", "must not be empty"),
    ("prompt-not-string", ev(prompt=5), "prompt", "string_type"),
    ("prompt-too-long", ev(prompt="x" * 101), "prompt", "longer than 100"),
    ("token-ids-empty", ev(token_ids=[]), "token_ids", "must not be empty"),
    ("token-id-negative", ev(token_ids=[3, -1]), "token_ids.1", "greater_than_equal"),
    ("token-id-float", ev(token_ids=[1.5]), "token_ids.0", "int_type"),
    ("token-id-string", ev(token_ids=["1"]), "token_ids.0", "int_type"),
    ("token-id-bool", ev(token_ids=[True]), "token_ids.0", "int_type"),
    ("token-id-huge", ev(token_ids=[2**40]), "token_ids.0", "less_than_equal"),
    ("token-ids-too-many", ev(token_ids=list(range(11))), "token_ids", "more than 10"),
    ("token-ids-not-list", ev(token_ids="1 2 3"), "token_ids", "list_type"),
    ("messages-empty", ev(messages=[]), "messages", "must not be empty"),
    ("message-bad-role", ev(messages=[{"role": "robot", "content": "x"}]), "messages.0.role", "literal_error"),
    ("message-missing-content", ev(messages=[{"role": "user"}]), "messages.0.content", "missing"),
    ("message-extra-field", ev(messages=[{"role": "user", "content": "x", "name": "bob"}]), "messages.0.name", "extra_forbidden"),
    ("message-part-without-text", ev(messages=[{"role": "user", "content": [{"type": "text"}]}]), "messages.0.content",
     "part 0.text: Field required"),
    ("message-part-unknown-type", ev(messages=[{"role": "user", "content": [{"type": "video"}]}]), "messages.0.content",
     "part 0: Input tag 'video'"),
    # Images: embedded PNG or JPEG data URIs only, bounded; nothing is ever fetched.
    ("image-remote-url", ev(messages=with_image("https://example.com/cat.png")), "messages.0.content",
     "part 1.image_url.url: remote image URLs are refused"),
    ("image-file-path", ev(messages=with_image("/etc/passwd")), "messages.0.content", "file paths and other URLs"),
    ("image-file-url", ev(messages=with_image("file:///etc/passwd")), "messages.0.content", "file paths and other URLs"),
    ("image-not-base64", ev(messages=with_image("data:image/png,rawbytes")), "messages.0.content", "must be base64"),
    ("image-bad-base64", ev(messages=with_image("data:image/png;base64,!!!")), "messages.0.content", "not valid base64"),
    ("image-gif", ev(messages=with_image(data_uri(b"GIF89a", "image/gif"))), "messages.0.content",
     "'image/gif' is not one of image/png, image/jpeg"),
    ("image-not-a-png", ev(messages=with_image(data_uri(b"\xff\xd8\xff" + bytes(9)))), "messages.0.content",
     "not a PNG file"),
    ("image-too-big", ev(messages=with_image(data_uri(PNG + bytes(100)))), "messages.0.content",
     "more than the limit of 100"),
    ("image-in-assistant-turn", ev(messages=with_image(data_uri(), role="assistant")), "messages.0",
     "images are allowed in user messages only"),
    ("images-too-many", ev(messages=[{"role": "user", "content": [image(data_uri())] * 3}]), "messages",
     "3 images, more than 2"),
    ("message-not-object", ev(messages=["hello"]), "messages.0", "model_type"),
    ("messages-all-empty", ev(messages=[{"role": "user", "content": " "}]), "messages", "every message content is empty"),
    ("messages-too-many", ev(messages=[{"role": "user", "content": "x"}] * 4), "messages", "more than 3"),
    ("message-too-long", ev(messages=[{"role": "user", "content": "x" * 51}]), "messages.0.content", "longer than 50"),
    ("metadata-list", ev(prompt="x", metadata=[1, 2]), "metadata", "dict_type"),
    ("metadata-too-deep", ev(prompt="x", metadata=deep(4)), "metadata", "deeper than 3"),
    ("metadata-too-big", ev(prompt="x", metadata={"k": "v" * 300}), "metadata", "more than 200"),
    # Integers beyond 64 bits: Python's JSON reads them, orjson (the size check, the ready event) cannot.
    # Raised TypeError, which stopped the extractor, until the fuzzing issue (#35).
    ("metadata-int-beyond-64-bits", b'{"request_id":"a","prompt":"hi","metadata":{"k":100000000000000000000000000000}}',
     "metadata", "Integer exceeds 64-bit range"),
    ("template-kwargs-int-beyond-64-bits", b'{"request_id":"a","messages":[{"role":"user","content":"hi"}],'
     b'"chat_template_kwargs":{"k":[-100000000000000000000000000000]}}', "chat_template_kwargs",
     "Integer exceeds 64-bit range"),
    ("event-too-large", ev(prompt="x", pad="y" * 5000), "(event)", "more than the limit of 4096"),
    ("schema-version", ev(prompt="x", schema_version=2), "schema_version", "literal_error"),
    # Generation parameters: each bounded, unknown keys refused.
    ("generation-no-max-tokens", ev(prompt="x", generation={"temperature": 0.5}), "generation.max_tokens", "missing"),
    ("generation-zero-tokens", ev(prompt="x", generation={"max_tokens": 0}), "generation.max_tokens", "greater_than"),
    ("generation-too-many-tokens", ev(prompt="x", generation={"max_tokens": 10**6}), "generation.max_tokens",
     "more than the limit of 8192"),
    ("generation-tokens-string", ev(prompt="x", generation={"max_tokens": "5"}), "generation.max_tokens", "int_type"),
    ("generation-negative-temperature", ev(prompt="x", generation={"max_tokens": 1, "temperature": -1}),
     "generation.temperature", "greater_than_equal"),
    ("generation-top-p-zero", ev(prompt="x", generation={"max_tokens": 1, "top_p": 0}), "generation.top_p",
     "greater_than"),
    ("generation-seed-huge", ev(prompt="x", generation={"max_tokens": 1, "seed": 2**63}), "generation.seed",
     "less_than_equal"),
    ("generation-stop-too-many", ev(prompt="x", generation={"max_tokens": 1, "stop": ["a"] * 17}),
     "generation.stop", "too_long"),
    ("generation-stop-token-negative", ev(prompt="x", generation={"max_tokens": 1, "stop_token_ids": [-1]}),
     "generation.stop_token_ids.0", "greater_than_equal"),
    ("generation-bad-turns", ev(prompt="x", generation={"max_tokens": 1, "turns": "some"}), "generation.turns",
     "literal_error"),
    ("generation-unknown-key", ev(prompt="x", generation={"max_tokens": 1, "beam_width": 4}),
     "generation.beam_width", "extra_forbidden"),
    ("generation-not-object", ev(prompt="x", generation=5), "generation", "model_type"),
    ("capture-unknown", ev(prompt="x", capture="first"), "capture", "literal_error"),
    # Chat-template variables: for chats only, named like variables, never the template call's own arguments.
    ("template-kwargs-on-text", ev(prompt="x", chat_template_kwargs={"enable_thinking": True}), "(event)",
     "apply to 'messages' only"),
    ("template-kwargs-not-object", ev(messages=CHAT, chat_template_kwargs=[1]), "chat_template_kwargs", "dict_type"),
    ("template-kwargs-bad-name", ev(messages=CHAT, chat_template_kwargs={"a b": 1}), "chat_template_kwargs",
     "is not an identifier"),
    ("template-kwargs-reserved", ev(messages=CHAT, chat_template_kwargs={"add_generation_prompt": False}),
     "chat_template_kwargs", "may not set 'add_generation_prompt'"),
    ("template-kwargs-too-deep", ev(messages=CHAT, chat_template_kwargs=deep(4)), "chat_template_kwargs",
     "deeper than 3"),
    ("template-kwargs-too-big", ev(messages=CHAT, chat_template_kwargs={"k": "v" * 120}), "chat_template_kwargs",
     "more than 100"),
]


@pytest.mark.parametrize("raw, loc, rule", [case[1:] for case in INVALID], ids=[case[0] for case in INVALID])
def test_invalid_event_names_field_and_rule(raw: bytes, loc: str, rule: str) -> None:
    with pytest.raises(ValidationError) as info:
        PromptEvent.model_validate_json(raw, context={"limits": SMALL})
    message = format_validation_error(info.value)
    assert message.startswith(f"{loc}: ") or f"; {loc}: " in message, message
    assert rule in message, message


def test_at_least_25_distinct_invalid_kinds() -> None:
    assert len({case[0] for case in INVALID}) >= 25


def test_text_event_accepted() -> None:
    event = PromptEvent.model_validate_json(ev(prompt="Hello there", metadata={"split": "train", "n": [1, 2]}))
    assert (event.kind, event.prompt, event.metadata) == ("prompt", "Hello there", {"split": "train", "n": [1, 2]})


def test_token_ids_event_accepted() -> None:
    event = PromptEvent.model_validate_json(ev(token_ids=[0, 5, 2**31 - 1]))
    assert (event.kind, event.token_ids) == ("token_ids", [0, 5, 2**31 - 1])


def test_chat_event_accepted() -> None:
    messages = [
        {"role": "system", "content": ""},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "tool", "content": "{}"},
    ]
    event = PromptEvent.model_validate_json(ev(messages=messages))
    assert event.kind == "messages"
    assert event.messages == [Message(**m) for m in messages]


def test_chat_with_template_kwargs_accepted() -> None:
    event = PromptEvent.model_validate_json(ev(messages=CHAT, chat_template_kwargs={"enable_thinking": False}))
    assert event.chat_template_kwargs == {"enable_thinking": False}


def test_chat_with_images_accepted() -> None:
    messages = [{"role": "user", "content": [image(data_uri()), image(data_uri(b"\xff\xd8\xff" + bytes(9), "image/jpeg"))]},
                {"role": "assistant", "content": [{"type": "text", "text": "Two"}, {"type": "text", "text": "images."}]}]
    event = PromptEvent.model_validate_json(ev(messages=messages), context={"limits": SMALL})
    assert [(i, j) for i, j, _ in event.images] == [(0, 0), (0, 1)]
    assert event.messages is not None and event.messages[1].text == "Two\nimages."


def test_request_id_allows_full_alphabet() -> None:
    rid = "Aa0._:-" * 18 + "Z"  # 127 characters of every allowed kind
    assert PromptEvent.model_validate_json(orjson.dumps({"request_id": rid, "prompt": "x"})).request_id == rid
    assert sample_id(rid) == rid  # a plain name is its own sample id


@pytest.mark.parametrize("rid", ["HumanEval/0", "..", "a..b", "../../etc/passwd", "prompt-é", "a\x00b", "a" * 1024,
                                 "/abs/path", "a b"])
def test_any_id_a_dataset_has_is_taken_and_its_sample_id_is_a_safe_name(rid: str) -> None:
    event = PromptEvent.model_validate_json(orjson.dumps({"request_id": rid, "prompt": "x"}))
    assert event.request_id == rid  # kept as the dataset gave it (the ready event's source_request_id)
    key = sample_id(rid)
    assert key != rid and sample_id(key) == key and "/" not in key and ".." not in key
    RequestParams(request_id=key, attempt_id="a" * 32, source=SourceRef(topic="t", partition=0, offset=0))
    assert len({sample_id(r) for r in ("HumanEval/0", "HumanEval_0", "HumanEval\\0")}) == 3  # never two in one


def test_limits_are_configurable() -> None:
    raw = ev(token_ids=list(range(11)))
    PromptEvent.model_validate_json(raw)  # default limits allow 11 ids
    with pytest.raises(ValidationError):
        PromptEvent.model_validate_json(raw, context={"limits": SMALL})


def test_events_are_immutable() -> None:
    event = PromptEvent.model_validate_json(ev(prompt="x"))
    with pytest.raises(ValidationError):
        event.prompt = "y"  # type: ignore[misc]


def test_error_message_is_bounded() -> None:
    with pytest.raises(ValidationError) as info:
        PromptEvent.model_validate_json(ev(token_ids=[-1] * 50))
    message = format_validation_error(info.value, limit=5)
    assert message.count("greater_than_equal") == 5 and message.endswith("and 45 more")
