"""Tiny random-weight Qwen2-VL-, Qwen2.5-VL- and Qwen3-VL-layout models: M-RoPE positions from
each image's grid.

Beside the LLaVA one (mmhandoff.models.tiny), for the position-state channel of the handoff:
a 2-block Qwen2-VL vision tower (patch 14, 2x2 merge), a 2-layer Qwen2 text model (hidden 128,
head dim 64, M-RoPE sections 8/12/12) and a byte-level BPE tokenizer with Qwen's special
tokens. Images are resized to between 4 and 64 merged tokens (min/max pixels), keeping their
aspect ratio, so that the grid differs with the image's shape and CPU runs stay fast.
Byte-identical on every build (fixed seed, no version stamps).

The Qwen2.5-VL variant (`build_tiny_qwen2_vl(out, variant="qwen2_5_vl")`) has the same text model,
tokenizer and processor sizes, and Qwen2.5-VL's vision tower (RMSNorm and gated MLP blocks,
window attention of 56 px with one full-attention block, as the 3B/7B models have every eighth).
The Qwen3-VL variant ("qwen3_vl"): a Qwen3 text model (interleaved M-RoPE), 16 px patches with
learned position embeddings, one deepstack level (`_build_tiny_qwen3_vl`).
"""

from __future__ import annotations

from pathlib import Path

from mmhandoff.models.build import SEED, VOCAB_SIZE, drop_volatile_fields, train_bpe

# Bump when anything below changes: the cache folder is keyed by it.
BUILD_VERSION = "2"  # 2: the chat template places videos
PATCH_SIZE = 14
MERGE_SIZE = 2
MIN_PIXELS = (PATCH_SIZE * MERGE_SIZE) ** 2 * 4  # at least 4 image tokens
MAX_PIXELS = (PATCH_SIZE * MERGE_SIZE) ** 2 * 64  # at most 64

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
            "<|image_pad|>", "<|video_pad|>"]
IMAGE_PLACEHOLDER = "<|vision_start|><|image_pad|><|vision_end|>"
VIDEO_PLACEHOLDER = "<|vision_start|><|video_pad|><|vision_end|>"  # Qwen's own, per video

CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' or part['type'] == 'image_url' %}" + IMAGE_PLACEHOLDER +
    "{% elif part['type'] == 'video' or part['type'] == 'video_url' %}" + VIDEO_PLACEHOLDER +
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


VARIANTS = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")
QWEN3_PATCH_SIZE = 16  # Qwen3-VL's patches


def build_tiny_qwen2_vl(out: Path, variant: str = "qwen2_vl") -> None:
    """Write config, weights, tokenizer and processor files into `out` (an existing folder)."""
    import torch
    from transformers import (
        Qwen2_5_VLConfig,
        Qwen2_5_VLForConditionalGeneration,
        Qwen2_5_VLProcessor,
        Qwen2VLConfig,
        Qwen2VLForConditionalGeneration,
        Qwen2VLImageProcessor,
        Qwen2VLProcessor,
        Qwen2VLVideoProcessor,
    )

    if variant not in VARIANTS:
        raise ValueError(f"unknown Qwen-VL variant {variant!r}; known: {', '.join(VARIANTS)}")
    if variant == "qwen3_vl":
        return _build_tiny_qwen3_vl(Path(out))
    qwen25 = variant == "qwen2_5_vl"

    out = Path(out)
    tokenizer, ids = _tokenizer()
    head_dim = 64
    vision = dict(
        depth=2, embed_dim=64, hidden_size=128, mlp_ratio=2, num_heads=2,
        patch_size=PATCH_SIZE, spatial_merge_size=MERGE_SIZE, temporal_patch_size=2,
        initializer_range=0.5,
    )
    if qwen25:  # its tower's own fields: output width, gated MLP width, windows
        vision = dict(
            depth=2, hidden_size=64, out_hidden_size=128, intermediate_size=128, num_heads=2,
            patch_size=PATCH_SIZE, spatial_merge_size=MERGE_SIZE, temporal_patch_size=2,
            window_size=56, fullatt_block_indexes=[1], tokens_per_second=2,
            initializer_range=0.5,
        )
    config = (Qwen2_5_VLConfig if qwen25 else Qwen2VLConfig)(
        text_config=dict(
            vocab_size=VOCAB_SIZE, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
            num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=4096,
            initializer_range=0.5,  # large random weights: greedy outputs vary with the input
            # M-RoPE: the rotary half-dimensions given to the temporal, height and width ids
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0,
                             "mrope_section": [8, 12, 12]},
            bos_token_id=ids["<|endoftext|>"], eos_token_id=ids["<|im_end|>"],
            pad_token_id=ids["<|endoftext|>"], tie_word_embeddings=False,
        ),
        vision_config=vision,
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=False,
    )
    assert sum(config.text_config.rope_parameters["mrope_section"]) == head_dim // 2
    model_class = (Qwen2_5_VLForConditionalGeneration if qwen25
                   else Qwen2VLForConditionalGeneration)
    config.architectures = [model_class.__name__]

    sizes = dict(min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS, patch_size=PATCH_SIZE,
                 merge_size=MERGE_SIZE, temporal_patch_size=2)
    torch.manual_seed(SEED)  # the same weights on every build
    # vLLM maps transformers 5's key layout itself for Qwen2-VL
    _save(out, model_class(config), tokenizer,
          (Qwen2_5_VLProcessor if qwen25 else Qwen2VLProcessor),
          Qwen2VLImageProcessor(**sizes), Qwen2VLVideoProcessor(**sizes))


def _build_tiny_qwen3_vl(out: Path) -> None:
    """Qwen3-VL's layout: a Qwen3 text model with interleaved M-RoPE, a vision tower of 16 px
    patches with learned position embeddings, and one deepstack level (the tower's first
    block's features added to the text model's first layer at the image's tokens)."""
    import torch
    from transformers import (
        Qwen2VLImageProcessor,
        Qwen3VLConfig,
        Qwen3VLForConditionalGeneration,
        Qwen3VLProcessor,
        Qwen3VLVideoProcessor,
    )

    tokenizer, ids = _tokenizer()
    config = Qwen3VLConfig(
        text_config=dict(
            vocab_size=VOCAB_SIZE, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
            num_attention_heads=2, num_key_value_heads=2, head_dim=64,
            max_position_embeddings=4096, initializer_range=0.5,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0,
                             "mrope_section": [8, 12, 12], "mrope_interleaved": True},
            bos_token_id=ids["<|endoftext|>"], eos_token_id=ids["<|im_end|>"],
            pad_token_id=ids["<|endoftext|>"], tie_word_embeddings=False,
        ),
        vision_config=dict(
            depth=2, hidden_size=64, intermediate_size=128, num_heads=2, out_hidden_size=128,
            patch_size=QWEN3_PATCH_SIZE, spatial_merge_size=MERGE_SIZE, temporal_patch_size=2,
            num_position_embeddings=64, deepstack_visual_indexes=[0], initializer_range=0.5,
        ),
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=False,
    )
    config.architectures = ["Qwen3VLForConditionalGeneration"]
    unit = (QWEN3_PATCH_SIZE * MERGE_SIZE) ** 2
    sizes = dict(min_pixels=unit * 4, max_pixels=unit * 64, patch_size=QWEN3_PATCH_SIZE,
                 merge_size=MERGE_SIZE, temporal_patch_size=2)
    torch.manual_seed(SEED)
    _save(out, Qwen3VLForConditionalGeneration(config), tokenizer,
          Qwen3VLProcessor, Qwen2VLImageProcessor(**sizes), Qwen3VLVideoProcessor(**sizes))


def _tokenizer():
    """The byte-level BPE tokenizer with Qwen's special tokens, and their ids."""
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=train_bpe(SPECIALS), eos_token="<|im_end|>", pad_token="<|endoftext|>",
        additional_special_tokens=SPECIALS[1:],
    )
    return tokenizer, {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIALS}


def _save(out: Path, model, tokenizer, processor_class, image_processor, video_processor):
    """The model (bf16), tokenizer, chat template and processor into `out`, with the fields that
    vary between builds dropped."""
    import torch

    model.to(torch.bfloat16).eval().save_pretrained(out)
    tokenizer.chat_template = CHAT_TEMPLATE
    processor_class(image_processor=image_processor, video_processor=video_processor,
                    tokenizer=tokenizer, chat_template=CHAT_TEMPLATE).save_pretrained(out)
    drop_volatile_fields(out, ("config.json", "tokenizer_config.json", "generation_config.json",
                                "processor_config.json"))
