"""A graph is a set of components that reach each other: `Frontend.link(Prefill).link(Decode)`.

A Component names the module that runs it (`python -m mmhandoff.<module>`) and whether it runs
an engine (then `serve` hands it the model and a NIXL port); nothing else lives here, so every
component also runs alone. Replicas, arguments and environment come from the graph's YAML
(configs/).

The links are the request's path, and the only place the wiring is written: a component that
calls others gets, for each role it calls, the endpoint of the first component down its links
that serves that role (`wiring`); `serve` passes them as `--<role> <endpoint>`. So the frontend
of `frontend -> prefill -> router -> decode` asks the router which prefill replica takes a
request, sends prefill's handoff to the router, and the router sends it to decode (prefill asks
the router too, for its bypass); in `frontend -> agg`
there is no prefill (`--prefill none`), and in `frontend -> prefill -> decode` no router
(prefill gets `--router none`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from mmhandoff.plane.endpoints import generate

# The roles each component plays for its callers, and the roles it calls (its flags). The
# router takes handoffs for decode, and answers prefill which replica holds a prompt's KV.
SERVES = {"prefill": ("prefill",), "decode": ("decode",), "agg": ("decode",),
          "router": ("decode", "router")}
CALLS = {"frontend": ("prefill", "decode", "router"), "router": ("decode",),
         "prefill": ("router",)}


@dataclass(eq=False)
class Component:
    module: str
    engine: bool = True
    links: list["Component"] = field(default_factory=list)

    @property
    def endpoint(self) -> str:
        """The endpoint it serves in its namespace (each component module serves one)."""
        return generate(self.module)

    def wiring(self) -> dict[str, str | None]:
        """{role it calls: endpoint of the first component down its links serving that role, or
        None where none does}."""
        order: list[Component] = []
        queue = list(self.links)
        while queue:  # breadth first: the nearest component serving a role wins
            c = queue.pop(0)
            if c not in order:
                order.append(c)
                queue += c.links
        return {role: next((c.endpoint for c in order if role in SERVES.get(c.module, ())),
                           None)
                for role in CALLS.get(self.module, ())}

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
