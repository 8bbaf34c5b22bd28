"""The ``tiny-qwen2.5-vl`` recipe: a tiny random Qwen2.5-VL with the tiny BPE plus vision tokens.

Same tokenizer training and text sizes as ``tiny-llama`` (see ``tiny_llama``), plus
Qwen2-VL's four vision tokens, a tiny vision tower, the ``Qwen2_5_VLForConditionalGeneration``
architecture and a ChatML template that renders OpenAI-style image parts as
``<|vision_start|><|image_pad|><|vision_end|>``. The image processor takes small images
to a handful of tokens. Builds in seconds and is byte-identical every time.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from hsx.models.cache import Recipe, check_saved_config
from hsx.models.tiny_llama import seeded, tiny_text_sizes, train_tiny_tokenizer

# Bump whenever the output changes (see `Recipe`).
TINY_QWEN2_5_VL_RECIPE = "tiny-qwen2.5-vl/1"

VISION_START, VISION_END = "<|vision_start|>", "<|vision_end|>"
IMAGE_PAD, VIDEO_PAD = "<|image_pad|>", "<|video_pad|>"
# Special tokens, as in Qwen2-VL: one id each, never split, dropped by
# decode(skip_special_tokens=True).
VISION_TOKENS = (VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD)

# The vision tower's geometry, shared by the model and the image/video processors: one
# merged token covers a (PATCH_SIZE * MERGE_SIZE)**2 pixel square.
PATCH_SIZE, MERGE_SIZE, TEMPORAL_PATCH_SIZE = 14, 2, 2
# Images are resized to between 2x2 and 4x4 merged tokens' worth of pixels (4 to 16 tokens).
MIN_PIXELS, MAX_PIXELS = 56 * 56, 112 * 112

# ChatML whose message content is either a string or a list of OpenAI-style parts: text
# parts render their text, image parts (``image`` or ``image_url``) one image placeholder
# that the processor expands to the image's token count. Like tiny-qwen3's, it never
# rewrites earlier turns, so a conversation's prefixes render as prefixes of it.
QWEN2_5_VL_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['content'] is string %}"
    "{{ message['content'] }}"
    "{% else %}"
    "{% for part in message['content'] %}"
    "{% if part['type'] == 'image' or part['type'] == 'image_url' %}"
    "{{ '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{% elif part['type'] == 'text' %}"
    "{{ part['text'] }}"
    "{% endif %}"
    "{% endfor %}"
    "{% endif %}"
    "{{ '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def build_tiny_qwen2_5_vl(dest: Path) -> None:
    """Write the tiny-qwen2.5-vl tokenizer, processor configs, config and weights into ``dest``."""
    tokenizer = train_tiny_tokenizer()
    tokenizer.add_tokens(list(VISION_TOKENS), special_tokens=True)
    tokenizer.chat_template = QWEN2_5_VL_CHAT_TEMPLATE
    tokenizer.save_pretrained(dest)
    _tiny_image_processor().save_pretrained(dest)
    _write_video_processor_config(dest)
    model = _init_tiny_qwen2_5_vl(_tiny_qwen2_5_vl_config(tokenizer))
    model.save_pretrained(dest)  # safetensors is the default
    check_saved_config(dest, "Qwen2_5_VLForConditionalGeneration")


def _tiny_image_processor() -> Any:
    # The PIL backend needs no torchvision; it saves as "Qwen2VLImageProcessor", which
    # loads with either backend.
    from transformers import Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil(
        min_pixels=MIN_PIXELS,
        max_pixels=MAX_PIXELS,
        patch_size=PATCH_SIZE,
        merge_size=MERGE_SIZE,
        temporal_patch_size=TEMPORAL_PATCH_SIZE,
    )


def _write_video_processor_config(dest: Path) -> None:
    # Qwen2VLVideoProcessor needs torchvision even to be built, so its config is written
    # by hand (the class defaults fill in the rest). The full Qwen2_5_VLProcessor then
    # loads wherever torchvision is installed.
    config = {
        "merge_size": MERGE_SIZE,
        "patch_size": PATCH_SIZE,
        "size": {"longest_edge": MAX_PIXELS, "shortest_edge": MIN_PIXELS},
        "temporal_patch_size": TEMPORAL_PATCH_SIZE,
        "video_processor_type": "Qwen2VLVideoProcessor",
    }
    text = json.dumps(config, indent=2, sort_keys=True) + "\n"
    (dest / "video_preprocessor_config.json").write_text(text, encoding="utf-8")


def _tiny_qwen2_5_vl_config(tokenizer: Any) -> Any:
    from transformers import Qwen2_5_VLConfig

    text = tiny_text_sizes(tokenizer)  # the vocabulary: the BPE plus the vision tokens
    # M-RoPE splits each head's rotary half into (temporal, height, width) sections:
    # Qwen2.5-VL's [16, 24, 24] for head_dim 128, scaled to head_dim 32.
    mrope_section = [4, 6, 6]
    assert sum(mrope_section) * 2 == text["head_dim"]
    ids = tokenizer.convert_tokens_to_ids(list(VISION_TOKENS))
    vision_start_id, vision_end_id, image_id, video_id = ids
    return Qwen2_5_VLConfig(
        text_config=dict(
            text,
            rope_parameters={
                "rope_type": "default",
                "mrope_section": mrope_section,
                "rope_theta": 1_000_000.0,  # Qwen2.5-VL's theta
            },
            use_sliding_window=False,
            sliding_window=None,
        ),
        vision_config=dict(
            depth=2,
            hidden_size=32,
            intermediate_size=64,
            num_heads=2,
            in_channels=3,
            patch_size=PATCH_SIZE,
            spatial_merge_size=MERGE_SIZE,
            temporal_patch_size=TEMPORAL_PATCH_SIZE,
            window_size=56,  # 2x2 merged tokens per attention window
            fullatt_block_indexes=[1],
            out_hidden_size=text["hidden_size"],
        ),
        image_token_id=image_id,
        video_token_id=video_id,
        vision_start_token_id=vision_start_id,
        vision_end_token_id=vision_end_id,
        tie_word_embeddings=text["tie_word_embeddings"],
        dtype=text["dtype"],
    )


def _init_tiny_qwen2_5_vl(config: Any) -> Any:
    from transformers import Qwen2_5_VLForConditionalGeneration

    return seeded(Qwen2_5_VLForConditionalGeneration, config)


RECIPE = Recipe("tiny-qwen2.5-vl", TINY_QWEN2_5_VL_RECIPE, build_tiny_qwen2_5_vl)
