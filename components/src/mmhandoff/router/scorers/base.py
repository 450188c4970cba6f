"""What every scorer is and sees (Scorer, Candidates), and the registry the router reads
(SCORERS, filled by `@register` where each scorer is defined)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, Sequence, TypeVar


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


SCORERS: dict[str, Scorer] = {}  # by name, as the router's weights name them
S = TypeVar("S")


def register(cls: type[S]) -> type[S]:
    """Class decorator: the scorer, under its name, in SCORERS."""
    SCORERS[cls.name] = cls()
    return cls

