"""Everything that touches vLLM lives here; a vLLM upgrade should touch only this package.

- engine: EngineSpec and start_engine (engine arguments per role, NIXL settings, environment)
- vllm_engine: VllmEngine, the mmhandoff.engine.Engine interface on vLLM's AsyncLLM
- inputs: prompt rendering, the metadata-only decode request, output helpers (for VllmEngine)
- load: EngineLoad (an engine's KV usage and queue lengths, from its stat stream)
- scheduler: FailClosedScheduler (loaded by the decode engine through `scheduler_cls`)
- spin, held_kv: vLLM plugins (entry point `vllm.general_plugins`, run in vLLM's own processes)
  that keep idle engine processes off the CPU
- fast_exit: a vLLM plugin that lets an engine's processes end by themselves in under a second
- amx: a vLLM plugin that asks the kernel for the AMX state vLLM's CPU attention needs
"""

from mmhandoff.vllm_adapter.engine import EngineSpec, start_engine
from mmhandoff.vllm_adapter.load import EngineLoad
from mmhandoff.vllm_adapter.vllm_engine import VllmEngine

__all__ = ["EngineLoad", "EngineSpec", "VllmEngine", "start_engine"]
