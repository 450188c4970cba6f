"""A tiny random-weight LLaVA-1.5-layout model, built locally and byte-identical on every build.

No model can be downloaded on our machines, so tests, the demo and CPU benchmarks use this one:
a CLIP vision tower (112 px, patch 14: 64 image tokens), a 2-layer Llama (hidden 128, head dim 64)
and a byte-level BPE tokenizer trained on a fixed corpus with `<image>` in its vocabulary. The
weights are random (fixed seed): outputs are gibberish but deterministic, which is all parity
tests need.

`ensure_tiny_model()` builds once into a cache folder (atomically: a half-built folder is never
used) and returns its path; `ensure_tiny_model(arch="qwen2_vl")` ("qwen2_5_vl", "qwen3_vl") does
the same for the tiny Qwen2-VL- (Qwen2.5-VL-, Qwen3-VL-) layout model
(mmhandoff.models.tiny_qwen2_vl).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

from mmhandoff.cache import cache_root
from mmhandoff.models.build import SEED, VOCAB_SIZE, drop_volatile_fields, train_bpe

# Bump when anything below changes: the cache folder is keyed by it.
BUILD_VERSION = "1"
IMAGE_SIZE = 112
PATCH_SIZE = 14
IMAGE_TOKENS = (IMAGE_SIZE // PATCH_SIZE) ** 2

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}SYSTEM: {% elif message['role'] == 'user' %}USER: "
    "{% else %}ASSISTANT: {% endif %}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' or part['type'] == 'image_url' %}<image>\n"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}\n"
    "{% endfor %}{% if add_generation_prompt %}ASSISTANT:{% endif %}"
)


ARCHES = ("llava", "qwen2_vl", "qwen2_5_vl", "qwen3_vl")


def default_cache_dir(arch: str = "llava") -> Path:
    root = cache_root()
    if arch in ("qwen2_vl", "qwen2_5_vl", "qwen3_vl"):
        from mmhandoff.models.tiny_qwen2_vl import BUILD_VERSION as version

        return Path(root) / f"tiny-{arch.replace('_', '-')}-v{version}"
    return Path(root) / f"tiny-llava-v{BUILD_VERSION}"


def builder(arch: str):
    """The function that writes `arch`'s tiny model into a folder."""
    if arch == "llava":
        return build_tiny_model
    if arch in ("qwen2_vl", "qwen2_5_vl", "qwen3_vl"):
        from functools import partial

        from mmhandoff.models.tiny_qwen2_vl import build_tiny_qwen2_vl

        return partial(build_tiny_qwen2_vl, variant=arch)
    raise ValueError(f"unknown tiny model architecture {arch!r}; known: {', '.join(ARCHES)}")


def ensure_tiny_model(path: str | os.PathLike | None = None, arch: str = "llava") -> Path:
    """Return a folder holding the tiny model of `arch`, building it there first if it is
    missing."""
    build = builder(arch)
    target = Path(path) if path is not None else default_cache_dir(arch)
    if (target / "config.json").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=target.name + ".", dir=target.parent))
    try:
        build(staging)
        try:
            staging.rename(target)
        except OSError:
            if not (target / "config.json").exists():  # lost a race only if the winner finished
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def build_tiny_model(out: Path) -> None:
    """Write config, weights, tokenizer and processor files into `out` (an existing folder)."""
    import torch
    from transformers import (
        CLIPImageProcessor,
        CLIPVisionConfig,
        LlamaConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
    )

    out = Path(out)
    tokenizer = _build_tokenizer()
    image_token_id = tokenizer.convert_tokens_to_ids("<image>")

    vision = CLIPVisionConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
        image_size=IMAGE_SIZE, patch_size=PATCH_SIZE, projection_dim=64, initializer_range=0.5,
    )
    text = LlamaConfig(
        vocab_size=VOCAB_SIZE, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=2048,
        initializer_range=0.5,  # large random weights: greedy outputs vary with the input
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=False,
    )
    config = LlavaConfig(
        vision_config=vision, text_config=text, image_token_index=image_token_id,
        image_seq_length=IMAGE_TOKENS, vision_feature_layer=-2,
        vision_feature_select_strategy="default", projector_hidden_act="gelu",
    )
    config.architectures = ["LlavaForConditionalGeneration"]

    torch.manual_seed(SEED)
    model = LlavaForConditionalGeneration(config).to(torch.bfloat16).eval()
    # vLLM's LLaVA loader expects the HF-1.x key layout (vision_tower.vision_model.*,
    # language_model.model.*, language_model.lm_head), not transformers 5's nested layout.
    state = {_legacy_key(k): v.contiguous() for k, v in model.state_dict().items()}
    from safetensors.torch import save_file

    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    config.save_pretrained(out)
    json.dump(
        {"bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id,
         "pad_token_id": tokenizer.pad_token_id},
        open(out / "generation_config.json", "w"), indent=2, sort_keys=True,
    )

    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(out)
    processor = CLIPImageProcessor(
        size={"shortest_edge": IMAGE_SIZE}, crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE},
    )
    processor.save_pretrained(out)
    json.dump(
        {"processor_class": "LlavaProcessor", "patch_size": PATCH_SIZE,
         "vision_feature_select_strategy": "default", "image_token": "<image>",
         "num_additional_image_tokens": 1},
        open(out / "processor_config.json", "w"), indent=2, sort_keys=True,
    )
    (out / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    drop_volatile_fields(out)


def _legacy_key(key: str) -> str:
    if key.startswith("model.vision_tower."):
        rest = key[len("model.vision_tower."):]
        return "vision_tower." + (rest if rest.startswith("vision_model.") else "vision_model." + rest)
    if key.startswith("model.multi_modal_projector."):
        return "multi_modal_projector." + key[len("model.multi_modal_projector."):]
    if key.startswith("model.language_model."):
        return "language_model.model." + key[len("model.language_model."):]
    if key.startswith("lm_head."):
        return "language_model." + key
    return key


def _build_tokenizer():
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_object=train_bpe(["<unk>", "<s>", "</s>", "<pad>", "<image>"], unk="<unk>"),
        unk_token="<unk>", bos_token="<s>", eos_token="</s>", pad_token="<pad>",
        additional_special_tokens=["<image>"],
    )


