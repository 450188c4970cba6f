"""frontend -> agg (the whole VLM on one engine; the reference for the disagg answers)."""

from mmhandoff.serve.graph import Component

Frontend = Component("frontend", engine=False)
Worker = Frontend.link(Component("agg"))
