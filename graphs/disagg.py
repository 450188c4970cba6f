"""frontend -> prefill_worker (encode + prefill) -> decode_worker (the media-free handoff)."""

from graphs.graph import Component

Frontend = Component("frontend", engine=False)
Prefill = Frontend.link(Component("prefill_worker"))
Decode = Prefill.link(Component("decode_worker"))
