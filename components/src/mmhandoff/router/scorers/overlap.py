"""KV overlap: how much of the request's prompt the instance would not have to pull or compute.

    score(i) = overlap(i) / blocks

overlap(i): the request's leading full blocks that instance i holds, from the KV index (the
engines' own block hashes); blocks: the prompt's full blocks. 0 for every instance when the prompt
has no full block.
"""

from __future__ import annotations

from mmhandoff.router.scorers.base import Candidates, register


@register
class OverlapScorer:
    name = "overlap"

    def score(self, c: Candidates) -> dict[int, float]:
        if c.blocks == 0:
            return dict.fromkeys(c.instances, 0.0)
        return {i: c.overlap.get(i, 0) / c.blocks for i in c.instances}
