"""The router's scorers: each rates every candidate instance for one request in [0, 1] (higher is
better); the router combines them with the weights of its configuration (router.pick). One
scorer per module, each with the formula in its docstring."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, Sequence


@dataclass
class Candidates:
    """What the scorers see of one routing decision."""

    instances: Sequence[int]  # live instances, in a stable order
    overlap: dict[int, int] = field(default_factory=dict)  # leading blocks each holds
    blocks: int = 0  # full blocks of the request's prompt
    in_flight: dict[int, int] = field(default_factory=dict)  # requests each has (scorers.load)
    kv_usage: dict[int, float] = field(default_factory=dict)  # share of its KV cache held


class Scorer(Protocol):
    name: str

    def score(self, c: Candidates) -> dict[int, float]: ...
