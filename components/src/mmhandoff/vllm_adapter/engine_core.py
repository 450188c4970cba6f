"""An AsyncLLM's engine core processes, seen from the process that started it: their ids, and
why the engine can no longer serve. Apart from engine.py (which starts engines) so that
VllmEngine can ask without importing its own maker."""

from __future__ import annotations


def engine_core_pids(engine) -> list[int]:
    """The process ids of an AsyncLLM's engine cores (each core's model workers are its
    children): for measuring an engine's CPU and checking its placement."""
    return [p.pid for p in core_processes(engine)]


def core_processes(engine) -> list:
    return engine.engine_core.resources.engine_manager.processes


def engine_dead_cause(engine) -> str | None:
    """Why an AsyncLLM can no longer serve (its core process died, its output loop failed), or
    None while it can. A flag vLLM's own monitor thread keeps: free to read."""
    if not engine.errored:
        return None
    task = engine.output_handler
    if task is not None and task.done() and not task.cancelled() and task.exception():
        return f"{type(task.exception()).__name__}: {task.exception()}"
    return "engine core process is gone"
