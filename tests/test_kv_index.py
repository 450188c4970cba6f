"""KvIndex (mmhandoff.router.index): the router's picture of which blocks each engine holds."""

from __future__ import annotations

import random

import pytest

from mmhandoff.router.index import KvIndex

pytestmark = pytest.mark.unit


def _brute(held: dict[int, set[int]], hashes: list[int]) -> dict[int, int]:
    """The definition, spelled out: the length of the longest prefix of `hashes` all held."""
    out = {}
    for instance, blocks in held.items():
        n = 0
        while n < len(hashes) and hashes[n] in blocks:
            n += 1
        out[instance] = n
    return out


def test_overlap_counts_leading_blocks_only():
    index = KvIndex()
    index.stored(1, [10, 11, 12])
    index.stored(2, [10, 12])  # a hole at 11: only block 0 counts
    index.stored(3, [20])
    assert index.overlap([10, 11, 12, 13]) == {1: 3, 2: 1, 3: 0}
    assert index.overlap([]) == {1: 0, 2: 0, 3: 0}


def test_removed_cleared_and_dropped_blocks_stop_counting():
    index = KvIndex()
    index.stored(1, [10, 11])
    index.stored(2, [10, 11])
    index.removed(1, [11])
    assert index.overlap([10, 11]) == {1: 1, 2: 2}
    index.cleared(2)  # its engine restarted: known, holding nothing
    assert index.overlap([10, 11]) == {1: 1, 2: 0}
    index.drop(1)  # left discovery: forgotten
    assert index.instances() == {2}
    assert len(index) == 0
    index.removed(7, [10])  # an instance never seen: nothing to do


def test_overlap_agrees_with_its_definition_on_random_histories():
    rng = random.Random(5)
    for _ in range(200):
        index, held = KvIndex(), {}
        for _ in range(rng.randrange(1, 30)):
            instance = rng.randrange(4)
            blocks = [rng.randrange(12) for _ in range(rng.randrange(1, 5))]
            kind = rng.choice(["stored", "stored", "removed", "cleared"])
            if kind == "stored":
                index.stored(instance, blocks)
                held.setdefault(instance, set()).update(blocks)
            elif kind == "removed":
                index.removed(instance, blocks)
                if instance in held:
                    held[instance] -= set(blocks)
            else:
                index.cleared(instance)
                if instance in held:
                    held[instance] = set()
        query = [rng.randrange(12) for _ in range(rng.randrange(0, 8))]
        assert index.overlap(query) == _brute(held, query)
        assert len(index) == len(set().union(*held.values())) if held else len(index) == 0
