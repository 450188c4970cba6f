"""One thread at a time reaps an engine core process.

At shutdown two threads of the engine's process wait for the same engine core: the one stopping
it (vLLM's `shutdown(procs, timeout)`: terminate, join, then force-kill what `is_alive()`) and
vLLM's monitor thread (`CoreEngineProcManager.monitor_engine_liveness`, which reads
`proc.exitcode` of a core it sees end, for up to a second after the stop began).
multiprocessing's `Popen.poll` is not safe for that: when the monitor's `waitpid` reaps the core
and the other thread's `waitpid` runs before the monitor stored the exit code, the latter gets
ECHILD, which `poll` reads as "still running". vLLM then logs "force killing remaining process
EngineCore" and SIGKILLs the pid of a process that already ended cleanly (a pid the system may
have given to another process by then). Seen as rare unclean graph stops in CI, ~0.3 s after
the stop began (tests/test_engine_reaping.py forces the interleaving).

A lock around each core's `poll` makes the second caller find the stored exit code.
"""

from __future__ import annotations

import functools
import threading


def serialize_reaping(processes) -> None:
    """Make `poll` (hence `is_alive`, `exitcode`, `join`) of these multiprocessing processes
    safe to call from several threads. Idempotent."""
    for proc in processes:
        popen = getattr(proc, "_popen", None)
        if popen is None or getattr(popen.poll, "mmhandoff_serialized", False):
            continue
        popen.poll = _locked(popen.poll)


def _locked(poll):
    lock = threading.Lock()

    @functools.wraps(poll)
    def locked_poll(*args, **kwargs):
        with lock:
            return poll(*args, **kwargs)

    locked_poll.mmhandoff_serialized = True
    return locked_poll
