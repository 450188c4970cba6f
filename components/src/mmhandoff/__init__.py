"""mmhandoff: multimodal LLM serving in which the decode tier never receives the media.

The data path, one subpackage per step (docs/architecture.md):
frontend (HTTP) -> router -> prefill (encode + prefill, signs a Handoff) -> decode (pulls KV).
Beside it: `wire` (every message between components), `vllm_adapter` (all of vLLM), `media`
(images and the URL guard), `serving` (runtime, one component's process, the graph supervisor,
the `mmhandoff` command), `models` (local test models), `graphs` (the one-line graphs).
Each component runs alone: `python -m mmhandoff.<frontend|prefill|decode|router|agg>`.
"""

__version__ = "0.1.0"
