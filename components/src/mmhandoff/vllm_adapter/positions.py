"""M-RoPE position state: each image's grid, read where prefill's processor computed it and
given to decode's engine as the one field of a data-less image feature.

vLLM internals used (each checked in tests/test_vllm_contract.py):
- the processed image item's `image_grid_thw` field (a MultiModalFieldElem of a
  MultiModalBatchedField), in the rendered engine input's `mm_kwargs`;
- Qwen2-VL's and Qwen2.5-VL's `iter_mm_grid_thw` reads only that field of
  `MultiModalFeatureSpec.data` when the model runner computes a request's M-RoPE positions
  (`_init_mrope_positions`, once, when the request is first scheduled);
- the scheduler sends the workers only a feature's `keep_on_cpu` fields once its span is
  covered by KV (`strip_covered_mm_data`, for M-RoPE models): the grid's field is one, as in
  the model's own field config;
- the vision config's `spatial_merge_size`.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Sequence

from mmhandoff.vllm_adapter.families import family
from mmhandoff.wire.handoff import Grid

GRID_KEY = "image_grid_thw"


def grid_merge(model_config) -> int | None:
    """Rows (and columns) of patches merged into one token, for a model whose positions derive
    from each image's grid; None for any other model."""
    known = family(model_config.hf_config.model_type)  # the families whose grids travel
    if not model_config.uses_mrope or known is None or known.positions != "grids":
        return None
    return int(model_config.hf_config.vision_config.spatial_merge_size)


def rendered_grids(engine_input: dict[str, Any]) -> list[Grid | None]:
    """Each image's grid as rendering computed it, in prompt order; None for an image vLLM's
    processor cache sent by hash alone (its processed data is in the engine core only)."""
    items = (engine_input.get("mm_kwargs") or {}).get("image") or []
    return [None if item is None else Grid(*(int(x) for x in item[GRID_KEY].data.tolist()))
            for item in items]


def grid_feature_data(grid: Grid):
    """A feature's data holding the grid and nothing else (no pixels)."""
    import torch
    from vllm.multimodal.inputs import (
        MultiModalFieldConfig,
        MultiModalFieldElem,
        MultiModalKwargsItem,
    )

    return MultiModalKwargsItem({GRID_KEY: MultiModalFieldElem(
        data=torch.tensor([grid.t, grid.h, grid.w], dtype=torch.int64),
        field=MultiModalFieldConfig.batched("image", keep_on_cpu=True).field)})


def is_kv_only(feature) -> bool:
    """Whether a request's feature carries no media (decode's: no data, or the grid alone), so
    that its span can only come from KV."""
    return feature.data is None or set(feature.data) <= {GRID_KEY}


class GridMemo:
    """The grids of images this engine rendered, by content hash (least recently used out):
    an image rendered again may be sent by hash alone, without its grid. A hash it no longer
    holds is rendered afresh (VllmEngine.render), never guessed."""

    def __init__(self, capacity: int = 100_000) -> None:  # ~100 bytes an entry
        self.capacity = capacity
        self._grids: OrderedDict[str, Grid] = OrderedDict()

    def resolve(self, identifiers: Sequence[str],
                grids: Sequence[Grid | None]) -> list[Grid | None]:
        """Each image's grid: the one rendering gave (recorded), else the recorded one, else
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
