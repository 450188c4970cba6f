"""The model families mmhandoff serves media-free, by the `model_type` of their config: the one
place to add one. For each: the media its processor takes (decode's engine is started with each
at 0, so vLLM builds no vision tower), and the position state that must travel in the handoff
for decode to place the image tokens without the media:

- "none": positions are token indices (1-D RoPE): nothing travels;
- "grids": M-RoPE positions derived from each image's and video's grid alone (vLLM's
  `iter_mm_grid_thw`): the grids travel (wire.handoff.Features.mm_grids), read by
  vllm_adapter.positions. For videos, what else the positions read: `video_seconds`, each
  video's seconds per temporal step (Qwen2.5-VL's `second_per_grid_ts`, which spaces the
  steps' temporal positions); `video_frames` "brackets", each step its own
  <start> tokens <end> after its timestamp's text in the prompt (Qwen3-VL: decode admits the
  prompt's layout against the grid, as vLLM's code searches it), else "run" (one run of tokens).

A model not in the table is served as a 1-D RoPE model taking images (and video, if its config
names a video token); an M-RoPE model not in the table is refused by decode (it would need more
of the media than travels). Adding a family: a row here, a tiny model of its layout in models/,
and its parity tests (tests/test_qwen2_vl.py, images and videos, is the shape to
follow)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Family:
    name: str
    model_types: tuple[str, ...]  # the config's `model_type`
    media: tuple[str, ...]  # what its processor takes, each disabled on decode
    positions: str = "none"  # the position state the handoff carries: "none" or "grids"
    video_seconds: bool = False
    video_frames: str = "run"  # "run" or "brackets"
    # images brought to the processor's resize size in the media processes (media.presize):
    # the same model input, pinned by tests/test_presize.py and test_media_pool_engine.py
    presize: bool = False


FAMILIES = (
    Family("LLaVA", ("llava",), media=("image",), presize=True),
    Family("Qwen2-VL", ("qwen2_vl",), media=("image", "video"), positions="grids",
           presize=True),
    Family("Qwen2.5-VL", ("qwen2_5_vl",), media=("image", "video"), positions="grids",
           video_seconds=True, presize=True),
    # interleaved M-RoPE and deepstack: the positions still come from each item's grid alone
    # (vLLM's `_iter_mm_grid_hw`), and deepstack's features are in prefill's KV; a video's
    # timestamps are text in the prompt
    Family("Qwen3-VL", ("qwen3_vl",), media=("image", "video"), positions="grids",
           video_frames="brackets", presize=True),
)


def family(model_type: str | None) -> Family | None:
    return next((f for f in FAMILIES if model_type in f.model_types), None)
