"""Every endpoint of the graph, named once. A component serves `<namespace>.<component>.<name>`;
its callers learn `<component>.generate` from the graph's links (serve/graph.py) and reach its
other endpoints by these names beside it.
"""

from __future__ import annotations

GENERATE = "generate"  # every component: its requests (chat in, or a handoff in)
KV_BLOCKS = "kv_blocks"  # each worker: the blocks its engine holds and its load (routers follow)
CLAIM = "claim"  # each prefill worker: a decode claims a handoff's KV once (prefill.claims)
HELD = "held"  # the router: which decode replica holds a prompt's blocks (prefill's bypass)
PLACE = "place"  # the router: which prefill replica takes a request (the frontend)


def generate(component: str) -> str:
    """`component`'s request endpoint, as a caller names it (without the namespace)."""
    return f"{component}.{GENERATE}"


def beside(endpoint: str, name: str) -> str:
    """The endpoint `name` of the component serving `endpoint` ("router.generate", HELD ->
    "router.held")."""
    return f"{endpoint.rsplit('.', 1)[0]}.{name}"
