"""Load: prefer the instance with the fewest requests in flight.

    score(i) = 1 - in_flight(i) / (max_j in_flight(j) + 1)

1.0 for an idle instance; never 0, so that load alone never rules an instance out. in_flight:
for decode, this router's own open streams to the instance or the requests its engine runs and
queues as its worker last published them, whichever is more; for prefill (whose requests do not
pass through the router), the published count alone (router.Router).
"""

from __future__ import annotations

from mmhandoff.router.scorers.base import Candidates, register


@register
class LoadScorer:
    name = "load"

    def score(self, c: Candidates) -> dict[int, float]:
        top = max((c.in_flight.get(i, 0) for i in c.instances), default=0)
        return {i: 1 - c.in_flight.get(i, 0) / (top + 1) for i in c.instances}
