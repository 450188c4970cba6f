"""frontend -> prefill -> router -> decode (replicas).

The frontend sends the handoff to the router, which picks the decode replica that already holds
most of its KV blocks (mmhandoff.router; docs/routing.md)."""

from mmhandoff.serving.graph import Component

Frontend = Component("frontend", engine=False)
Prefill = Frontend.link(Component("prefill"))
Router = Prefill.link(Component("router", engine=False))
Decode = Router.link(Component("decode"))
