"""Everything that touches vLLM lives here; a vLLM upgrade should touch only this package.
Laid out by the process the code runs in:

- here, the worker's own process (where vLLM's AsyncLLM lives): engine (EngineSpec and
  start_engine: engine arguments per role, NIXL settings, environment), vllm_engine (VllmEngine,
  the mmhandoff.engine.Engine interface on AsyncLLM), inputs (prompt rendering, the
  metadata-only decode request, output helpers), load (EngineLoad, from the engine's stat
  stream), engine_core and reaping (the engine's core processes), kv_events (the engine's KV
  events), block_hashes (also in the router's process), positions, logprobs, continued_text;
- core/: what vLLM loads by dotted path into its engine core: the fail-closed scheduler
  (`scheduler_cls`) and the NIXL connector;
- plugins/: vLLM general plugins, loaded in every vLLM process (spin, held_kv, fast_exit, amx).
"""

from mmhandoff.vllm_adapter.engine import EngineSpec, start_engine
from mmhandoff.vllm_adapter.load import EngineLoad
from mmhandoff.vllm_adapter.vllm_engine import VllmEngine

__all__ = ["EngineLoad", "EngineSpec", "VllmEngine", "start_engine"]
