"""frontend -> prefill -> router -> decode (replicas).

The frontend asks the router which prefill replica takes a request, then sends the handoff to
the router, which picks the decode replica; each time the one that already holds most of its KV
blocks (mmhandoff.router; docs/routing.md). The frontend finds the router down its links, so the
graph needs no link back from the frontend to it."""

from mmhandoff.serve.graph import Component

Frontend = Component("frontend", engine=False)
Prefill = Frontend.link(Component("prefill"))
Router = Prefill.link(Component("router", engine=False))
Decode = Router.link(Component("decode"))
