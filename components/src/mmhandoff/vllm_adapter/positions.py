"""M-RoPE position state: each image's and video's grid (and a Qwen2.5-VL video's seconds per
temporal step), read where prefill's processor computed them and given to decode's engine as
the only fields of a data-less feature.

vLLM internals used (each checked in tests/test_vllm_contract.py):
- the processed item's `image_grid_thw` / `video_grid_thw` field (a MultiModalFieldElem of a
  MultiModalBatchedField) and Qwen2.5-VL's `second_per_grid_ts`, in the rendered engine input's
  `mm_kwargs`;
- Qwen2-VL's and Qwen2.5-VL's `iter_mm_grid_thw` read only those fields of
  `MultiModalFeatureSpec.data` when the model runner computes a request's M-RoPE positions
  (`_init_mrope_positions`, once, when the request is first scheduled); Qwen3-VL's
  `_iter_mm_grid_hw` reads the grids and finds each video frame's bracket in the prompt's tokens;
- the scheduler sends the workers only a feature's `keep_on_cpu` fields once its span is
  covered by KV (`strip_covered_mm_data`, for M-RoPE models): these fields are, as in the
  models' own field configs;
- the vision config's `spatial_merge_size`, the config's `vision_start_token_id`,
  `vision_end_token_id` and `video_token_id` (Qwen3-VL).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Sequence

from mmhandoff.vllm_adapter.families import family
from mmhandoff.wire.handoff import Grid, GridRules

GRID_KEYS = {"image": "image_grid_thw", "video": "video_grid_thw"}
GRID_KEY = GRID_KEYS["image"]
SECONDS_KEY = "second_per_grid_ts"  # Qwen2.5-VL's videos


def grid_rules(model_config) -> GridRules | None:
    """What decode admits for a model whose positions derive from each item's grid; None for
    any other model."""
    known = family(model_config.hf_config.model_type)  # the families whose grids travel
    if not model_config.uses_mrope or known is None or known.positions != "grids":
        return None
    config = model_config.hf_config
    frames = None
    if known.video_frames == "brackets":
        frames = (int(config.vision_start_token_id), int(config.vision_end_token_id),
                  int(config.video_token_id))
    return GridRules(merge=int(config.vision_config.spatial_merge_size),
                     video_seconds=known.video_seconds, frame_tokens=frames)


def rendered_grids(engine_input: dict[str, Any]) -> dict[str, list[Grid | None]]:
    """Per modality, each item's grid as rendering computed it, in prompt order; None for an item
    vLLM's processor cache sent by hash alone (its processed data is in the engine core only)."""
    out = {}
    for modality, key in GRID_KEYS.items():
        items = (engine_input.get("mm_kwargs") or {}).get(modality) or []
        out[modality] = [None if item is None else _grid(item, key) for item in items]
    return {m: grids for m, grids in out.items() if grids}


def _grid(item, key: str) -> Grid:
    t, h, w = (int(x) for x in item[key].data.tolist())
    seconds = item.get(SECONDS_KEY)
    # vLLM computes positions from `.item()` of its tensor (bf16 on a bf16 model): that value
    return Grid(t=t, h=h, w=w, seconds=None if seconds is None else float(seconds.data.item()))


def grid_feature_data(modality: str, grid: Grid):
    """A feature's data holding the grid (and a video's seconds per step) and nothing else."""
    import torch
    from vllm.multimodal.inputs import (
        MultiModalFieldConfig,
        MultiModalFieldElem,
        MultiModalKwargsItem,
    )

    def field(data):
        return MultiModalFieldElem(
            data=data, field=MultiModalFieldConfig.batched(modality, keep_on_cpu=True).field)

    fields = {GRID_KEYS[modality]: field(torch.tensor([grid.t, grid.h, grid.w],
                                                      dtype=torch.int64))}
    if grid.seconds is not None:
        fields[SECONDS_KEY] = field(torch.tensor(grid.seconds, dtype=torch.float64))
    return MultiModalKwargsItem(fields)


def is_kv_only(feature) -> bool:
    """Whether a request's feature carries no media (decode's: no data, or the grid alone), so
    that its span can only come from KV."""
    return feature.data is None or set(feature.data) <= {*GRID_KEYS.values(), SECONDS_KEY}


class GridMemo:
    """The grids of items this engine rendered, by content hash (least recently used out):
    an item rendered again may be sent by hash alone, without its grid. A hash it no longer
    holds is rendered afresh (VllmEngine.render), never guessed."""

    def __init__(self, capacity: int = 100_000) -> None:  # ~100 bytes an entry
        self.capacity = capacity
        self._grids: OrderedDict[str, Grid] = OrderedDict()

    def resolve(self, identifiers: Sequence[str],
                grids: Sequence[Grid | None]) -> list[Grid | None]:
        """Each item's grid: the one rendering gave (recorded), else the recorded one, else
        None."""
        out = []
        for digest, grid in zip(identifiers, grids):
            if grid is not None:
                self._grids[digest] = grid
            else:
                grid = self._grids.get(digest)
            if grid is not None:
                self._grids.move_to_end(digest)
            out.append(grid)
        while len(self._grids) > self.capacity:
            self._grids.popitem(last=False)
        return out

    def __len__(self) -> int:
        return len(self._grids)
