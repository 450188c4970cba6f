"""Real-size model shapes without weights, for GPU runs with `load_format="dummy"`.

No checkpoint can be downloaded here or on the lent GPU. vLLM's dummy loader fills a model's
weights with random values, so a folder with a real architecture's `config.json` plus the tiny
model's tokenizer, chat template and processor files (image size and token count changed to
match) is enough to measure what a real-size model costs: KV bytes per token, prefill and decode
compute, vision-encoder time. Outputs are gibberish, deterministic per engine seed.

    path = ensure_dummy_model("llava-1.5-7b")   # EngineSpec(..., extra={"load_format": "dummy"})

A Qwen2.5-VL shape ("qwen2.5-vl-7b") starts from the tiny Qwen2.5-VL (its tokenizer, chat
template with images and videos, processor) with the real model's sizes and the real
processor's pixel bounds (images: 4 to 16,384 tokens; video frames: 128 to 768).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from mmhandoff.models.tiny import default_cache_dir, ensure_tiny_model

# CLIP ViT-L/14 at 336 px: 576 image tokens
_CLIP_L_336 = dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=24,
                   num_attention_heads=16, image_size=336, patch_size=14, projection_dim=768)
# LLaVA-1.5-7B: CLIP ViT-L/14 at 336 px and Llama-2-7B.
SHAPES = {
    "llava-1.5-7b": {
        "vision": _CLIP_L_336,
        "text": dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                     num_attention_heads=32, num_key_value_heads=32, vocab_size=32064,
                     max_position_embeddings=4096),
    },
    # TinyLLaVA (the LLaVA-1.5 layout): the same CLIP and TinyLlama-1.1B (grouped
    # query attention, 4 KV heads): four engines fit on one 80 GB GPU
    "tinyllava-1.1b": {
        "vision": _CLIP_L_336,
        "text": dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
                     num_attention_heads=32, num_key_value_heads=4, vocab_size=32064,
                     max_position_embeddings=4096),
    },
    # Qwen2.5-VL-7B: its 32-block vision tower (windows of 112 px, full attention every 8th
    # block) and Qwen2-7B text model (28 layers, 4 KV heads, M-RoPE sections 16/24/24)
    "qwen2.5-vl-7b": {
        "arch": "qwen2_5_vl",
        "vision": dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16,
                       out_hidden_size=3584, patch_size=14, spatial_merge_size=2,
                       temporal_patch_size=2, window_size=112,
                       fullatt_block_indexes=[7, 15, 23, 31], tokens_per_second=2),
        "text": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                     num_attention_heads=28, num_key_value_heads=4, vocab_size=152064,
                     max_position_embeddings=32768,
                     rope_parameters={"rope_type": "default", "rope_theta": 1000000.0,
                                      "mrope_section": [16, 24, 24]}),
        "pixels": {"image_processor": (56 * 56, 28 * 28 * 16384),
                   "video_processor": (28 * 28 * 128, 28 * 28 * 768)},
    },
}
_COPIED = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
           "generation_config.json", "chat_template.jinja", "processor_config.json")


def ensure_dummy_model(shape: str, path: str | os.PathLike | None = None) -> Path:
    """A folder with `shape`'s config and the tiny model's tokenizer (written once)."""
    if shape not in SHAPES:
        raise ValueError(f"unknown model shape {shape!r}; known: {sorted(SHAPES)}")
    target = Path(path) if path is not None else default_cache_dir().parent / f"dummy-{shape}"
    if (target / "config.json").exists():
        return target
    sizes = SHAPES[shape]
    tiny = ensure_tiny_model(arch=sizes.get("arch", "llava"))
    staging = target.with_name(target.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    for name in _COPIED:
        if (tiny / name).exists():
            shutil.copy(tiny / name, staging / name)
    config = json.loads((tiny / "config.json").read_text())
    config["vision_config"].update(sizes["vision"])
    config["text_config"].update(sizes["text"])
    config["text_config"].pop("layer_types", None)  # the tiny model's, one per layer: derived
    if "pixels" in sizes:  # Qwen-VL: the processors' pixel bounds, in processor_config.json
        processor = json.loads((tiny / "processor_config.json").read_text())
        for part, (least, most) in sizes["pixels"].items():
            processor[part]["size"] = {"shortest_edge": least, "longest_edge": most}
            processor[part].pop("min_pixels", None)
            processor[part].pop("max_pixels", None)
        (staging / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        (staging / "processor_config.json").write_text(json.dumps(processor, indent=2,
                                                                  sort_keys=True))
        staging.rename(target)
        return target
    v = sizes["vision"]
    tokens = (v["image_size"] // v["patch_size"]) ** 2
    config["image_seq_length"] = tokens
    (staging / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    pre = json.loads((tiny / "preprocessor_config.json").read_text())
    pre["size"] = {"shortest_edge": v["image_size"]}
    pre["crop_size"] = {"height": v["image_size"], "width": v["image_size"]}
    (staging / "preprocessor_config.json").write_text(json.dumps(pre, indent=2, sort_keys=True))
    staging.rename(target)
    return target
