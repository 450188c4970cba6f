"""The prefill side's memo of rendered images' grids (mmhandoff.vllm_adapter.positions)."""

import pytest

from mmhandoff.vllm_adapter.positions import GridMemo
from mmhandoff.wire.handoff import Grid

pytestmark = pytest.mark.unit

A, B = Grid(t=1, h=4, w=6), Grid(t=1, h=8, w=2)


def test_a_grid_rendered_once_is_found_again_by_hash():
    memo = GridMemo()
    assert memo.resolve(["a", "b"], [A, None]) == [A, None]  # b never rendered with its grid
    assert memo.resolve(["b", "a", "a"], [B, None, None]) == [B, A, A]
    assert len(memo) == 2


def test_the_least_recently_used_grid_leaves_first():
    memo = GridMemo(capacity=2)
    memo.resolve(["a", "b"], [A, B])
    memo.resolve(["a"], [None])  # a used again: b is now the oldest
    memo.resolve(["c"], [A])
    assert memo.resolve(["a", "b", "c"], [None, None, None]) == [A, None, A]
