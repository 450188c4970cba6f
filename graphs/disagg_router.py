"""frontend -> prefill -> router -> decode (replicas).

The frontend sends the handoff to the router, which picks the decode replica (pass-through round
robin until the KV-aware choice lands; mmhandoff.router)."""

from mmhandoff.serving.graph import Component

Frontend = Component("frontend", engine=False)
Prefill = Frontend.link(Component("prefill"))
Router = Prefill.link(Component("router", engine=False))
Decode = Router.link(Component("decode"))
