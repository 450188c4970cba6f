"""frontend -> prefill_worker -> router -> decode_worker (replicas).

The frontend sends the handoff to the router, which picks the decode replica (pass-through round
robin until the KV-aware choice lands; components/router.py)."""

from graphs.graph import Component

Frontend = Component("frontend", engine=False)
Prefill = Frontend.link(Component("prefill_worker"))
Router = Prefill.link(Component("router", engine=False))
Decode = Router.link(Component("decode_worker"))
