"""Real-size model shapes without weights, for GPU runs with `load_format="dummy"`.

No checkpoint can be downloaded here or on the lent GPU. vLLM's dummy loader fills a model's
weights with random values, so a folder with a real architecture's `config.json` plus the tiny
model's tokenizer, chat template and processor files (image size and token count changed to
match) is enough to measure what a real-size model costs: KV bytes per token, prefill and decode
compute, vision-encoder time. Outputs are gibberish, deterministic per engine seed.

    path = ensure_dummy_model("llava-1.5-7b")   # EngineSpec(..., extra={"load_format": "dummy"})
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
    tiny = ensure_tiny_model()
    staging = target.with_name(target.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    for name in _COPIED:
        if (tiny / name).exists():
            shutil.copy(tiny / name, staging / name)
    sizes = SHAPES[shape]
    config = json.loads((tiny / "config.json").read_text())
    config["vision_config"].update(sizes["vision"])
    config["text_config"].update(sizes["text"])
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
