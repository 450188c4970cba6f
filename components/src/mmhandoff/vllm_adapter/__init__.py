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

import importlib

# Loaded on first use, not with the package: vLLM imports plugins/ and core/ by dotted path in
# every one of its processes (engine core, workers), where the API process's modules (AsyncLLM,
# its stat loggers) are not used: loading the amx plugin in a fresh process took 12.2 s with
# them and 6.2 s without on a 2-core host.
_EXPORTS = {"EngineSpec": "engine", "start_engine": "engine", "EngineLoad": "load",
            "VllmEngine": "vllm_engine"}

__all__ = ["EngineLoad", "EngineSpec", "VllmEngine", "start_engine"]


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
