"""frontend -> prefill (encode + prefill) -> decode (the media-free handoff)."""

from mmhandoff.serve.graph import Component

Frontend = Component("frontend", engine=False)
Prefill = Frontend.link(Component("prefill"))
Decode = Prefill.link(Component("decode"))
