"""frontend -> agg_worker (the whole VLM on one engine; the reference for the disagg answers)."""

from graphs.graph import Component

Frontend = Component("frontend", engine=False)
Worker = Frontend.link(Component("agg_worker"))
