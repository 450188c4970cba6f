"""mmhandoff: multimodal LLM serving in which the decode tier never receives the media.

The data path, one subpackage per step (docs/architecture.md):
frontend (HTTP) -> router -> prefill (encode + prefill, signs a Handoff) -> decode (pulls KV).
Beside it: `wire` (every message between components), `engine` (the Engine every worker holds,
and what workers share around it), `vllm_adapter` (all of vLLM), `media` (images and the URL
guard), `plane` (the Dynamo runtime, endpoint names, keys), `process` (one component's process),
`serve` (the `mmhandoff` command and its graph supervisor), `models` (local test models),
`graphs` (the one-line graphs).
Each component runs alone: `python -m mmhandoff.<frontend|prefill|decode|router|agg>`.
"""

__version__ = "0.1.0"
