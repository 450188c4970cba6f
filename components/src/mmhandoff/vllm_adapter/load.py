"""An engine's latest scheduler load (KV cache usage, running and waiting requests) and the
tokens it has generated.

vLLM hands scheduler stats to stat loggers after every engine step; `EngineLoad.logger_factory`
is such a logger (a public extension point of AsyncLLM), so reading the load costs no call into
the engine. The values are as of the engine's last step.
"""

from __future__ import annotations

import time
from typing import Callable

from vllm.v1.metrics.loggers import StatLoggerBase


class EngineLoad:
    def __init__(self) -> None:
        self.kv_cache_usage = 0.0
        self.num_running = 0
        self.num_waiting = 0
        self.generation_tokens = 0  # generated since start, all requests
        self.requests_finished = 0  # requests the engine finished since start (any reason)
        self.updated_at = 0.0  # time.monotonic() of the last step seen; 0: none yet
        # called (on the engine's output loop) when running or waiting changes
        self.on_change: Callable[[], None] | None = None

    def logger_factory(self):
        load = self

        class _LoadLogger(StatLoggerBase):
            def __init__(self, vllm_config, engine_index: int = 0) -> None:
                pass

            def record(self, scheduler_stats, iteration_stats, *args, **kwargs) -> None:
                if scheduler_stats is not None:
                    before = load.num_running, load.num_waiting
                    load.kv_cache_usage = scheduler_stats.kv_cache_usage
                    load.num_running = scheduler_stats.num_running_reqs
                    load.num_waiting = scheduler_stats.num_waiting_reqs
                    load.updated_at = time.monotonic()
                    if load.on_change is not None and before != (load.num_running,
                                                                 load.num_waiting):
                        load.on_change()
                if iteration_stats is not None:
                    load.generation_tokens += iteration_stats.num_generation_tokens
                    load.requests_finished += len(iteration_stats.finished_requests)

            def log_engine_initialized(self) -> None:
                pass

        return _LoadLogger
