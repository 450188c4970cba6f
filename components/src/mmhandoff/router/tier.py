"""One tier of engine workers (prefill or decode) as the router sees it: the live instances (its
generate endpoint's Dynamo client), the blocks each holds (a KvIndex) and what each last
published of its load. The tier's Follower (router.follow) keeps the last three from the
workers' kv_blocks streams; the router reads them for both tiers alike."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from mmhandoff.router.index import KvIndex


@dataclass
class Tier:
    name: str
    client: Any = None  # Dynamo client of the tier's generate endpoint; None: no such tier
    index: KvIndex = field(default_factory=KvIndex)
    loads: dict[int, int] = field(default_factory=dict)  # requests running + waiting
    kv_usage: dict[int, float] = field(default_factory=dict)  # the share of its KV cache held

    def live(self) -> list[int]:
        """The instances in discovery now, in a stable order."""
        return sorted(self.client.instance_ids()) if self.client is not None else []
