"""KV usage: prefer the instance whose KV cache has the most room.

    score(i) = 1 - kv_usage(i)

kv_usage(i): the share of the instance's KV cache blocks that requests hold, 0 to 1, as its
worker last published it (its kv_blocks stream, with each change in its requests). Prefix-cached
blocks no request holds count as free: they are evicted when room is needed. 1.0 for an
instance not heard from yet.
"""

from __future__ import annotations

from mmhandoff.router.scorers.base import Candidates, register


@register
class KvUsageScorer:
    name = "kv_usage"

    def score(self, c: Candidates) -> dict[int, float]:
        return {i: 1 - min(max(c.kv_usage.get(i, 0.0), 0.0), 1.0) for i in c.instances}
