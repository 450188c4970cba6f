"""The model families mmhandoff serves media-free, by the `model_type` of their config: the one
place to add one. For each: the media its processor takes (decode's engine is started with each
at 0, so vLLM builds no vision tower), and the position state that must travel in the handoff
for decode to place the image tokens without the media:

- "none": positions are token indices (1-D RoPE): nothing travels;
- "grids": M-RoPE positions derived from each image's grid alone (vLLM's `iter_mm_grid_thw`):
  the grids travel (wire.handoff.Features.mm_grids), read by vllm_adapter.positions.

A model not in the table is served as a 1-D RoPE model taking images (and video, if its config
names a video token); an M-RoPE model not in the table is refused by decode (it would need more
of the media than travels). Video is not served media-free yet (issue 36): only images' grids
travel. Adding a family: a row here, a tiny model of its layout in models/,
and its parity tests (tests/test_qwen2_vl.py is the shape to follow)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Family:
    name: str
    model_types: tuple[str, ...]  # the config's `model_type`
    media: tuple[str, ...]  # what its processor takes, each disabled on decode
    positions: str = "none"  # the position state the handoff carries: "none" or "grids"


FAMILIES = (
    Family("LLaVA", ("llava",), media=("image",)),
    Family("Qwen2-VL", ("qwen2_vl", "qwen2_5_vl"), media=("image", "video"), positions="grids"),
    # interleaved M-RoPE and deepstack: the positions still come from each image's grid alone
    # (vLLM's `_iter_mm_grid_hw`), and deepstack's features are in prefill's KV
    Family("Qwen3-VL", ("qwen3_vl",), media=("image", "video"), positions="grids"),
)


def family(model_type: str | None) -> Family | None:
    return next((f for f in FAMILIES if model_type in f.model_types), None)
