"""A graph is a set of components that reach each other: `Frontend.link(Prefill).link(Decode)`.

A Component names the module that runs it (`python -m components.<module>`) and whether it runs
an engine (then `serve` hands it the model and a NIXL port); nothing else lives here, so every
component also runs alone. Replicas, arguments and environment come from the graph's YAML
(configs/).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(eq=False)
class Component:
    module: str
    engine: bool = True
    links: list["Component"] = field(default_factory=list)

    def link(self, other: "Component") -> "Component":
        """Record that this component calls `other`; returns `other` so links chain."""
        self.links.append(other)
        return other

    def reachable(self) -> list["Component"]:
        """This component and every one it reaches, callees first (they must be up first)."""
        order: list[Component] = []

        def visit(c: Component) -> None:
            if c in order:
                return
            for callee in c.links:
                visit(callee)
            order.append(c)

        visit(self)
        return order
