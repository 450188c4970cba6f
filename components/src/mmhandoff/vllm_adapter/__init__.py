"""Everything that touches vLLM lives here; a vLLM upgrade should touch only this package.

- engine: EngineSpec and start_engine (engine arguments per role, NIXL settings, environment)
- inputs: prompt rendering, the metadata-only decode request, output helpers
- load: EngineLoad (an engine's KV usage and queue lengths, from its stat stream)
- scheduler: FailClosedScheduler (loaded by the decode engine through `scheduler_cls`)
- spin, held_kv: vLLM plugins (entry point `vllm.general_plugins`, run in vLLM's own processes)
  that keep idle engine processes off the CPU
- fast_exit: a vLLM plugin that lets an engine's processes end by themselves in under a second
"""

from mmhandoff.vllm_adapter.engine import (
    EngineSpec,
    engine_core_pids,
    engine_dead_cause,
    start_engine,
)
from mmhandoff.vllm_adapter.inputs import (
    RenderedPrompt,
    kv_coverage_cause,
    kv_only_request,
    kv_stats,
    model_fingerprint,
    render_prompt,
    sampling_params,
)
from mmhandoff.vllm_adapter.load import EngineLoad

__all__ = [
    "EngineLoad", "EngineSpec", "RenderedPrompt", "engine_core_pids", "engine_dead_cause",
    "kv_coverage_cause",
    "kv_only_request", "kv_stats", "model_fingerprint", "render_prompt", "sampling_params",
    "start_engine",
]
