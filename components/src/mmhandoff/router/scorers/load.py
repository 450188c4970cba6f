"""Load: prefer the instance with the fewest requests in flight from this router.

    score(i) = 1 - in_flight(i) / (max_j in_flight(j) + 1)

1.0 for an idle instance; never 0, so that load alone never rules an instance out. Counts are
this router's own open streams (exact for one router; with several routers, each balances its
share).
"""

from __future__ import annotations

from mmhandoff.router.scorers import Candidates


class LoadScorer:
    name = "load"

    def score(self, c: Candidates) -> dict[int, float]:
        top = max((c.in_flight.get(i, 0) for i in c.instances), default=0)
        return {i: 1 - c.in_flight.get(i, 0) / (top + 1) for i in c.instances}
