"""vLLM plugin (entry point `vllm.general_plugins`): an engine's processes end by themselves, in
well under a second, instead of being killed by vLLM after 5 s.

vLLM freezes an engine's start-up objects out of the garbage collector's sight and undoes that
when the engine stops: the engine core (`cleanup_dist_env_and_memory`) and the model worker
(`GPUModelRunner._cleanup_profiling_kv_cache`) run full collections, and then each spawned
process's interpreter scans the whole heap again as it finalizes. On a 2-core host that took
seconds per process to free nothing (`VLLM_GC_DEBUG`: 0 of 700,000 objects collected, 0.4 s a
pass): the worker needed ~3 s to exit and the engine core was still collecting when vLLM's
process manager force-killed it at the end of its 5 s grace. Every engine's stop took 5 s and
ended in SIGKILL (vLLM issue #48620).

Here the teardown of vLLM's engine-core and worker processes (`EngineCoreProc.shutdown`,
`WorkerProc.shutdown`, each called once as its process ends) runs with `gc.collect` a no-op and
deaf to further SIGTERM and SIGINT (vLLM's process manager still kills it after 5 s), and
the process then leaves the way a fork-started child does: after `multiprocessing` has run its
own exit steps (finalizers, thread joins, stream flushes), `os._exit` with the same exit code,
skipping the interpreter's finalization. The shared-memory rings it created, which vLLM
unlinks only when they are collected, are unlinked first. Everything else in vLLM's teardown
(executor, scheduler, KV connector, message queues, distributed state) runs as before; the OS
takes the memory back. In-process engines (`EngineCore`) keep vLLM's collections, which free their memory
for reuse. Set `MMHANDOFF_FAST_EXIT=default` to keep vLLM's behaviour.

If vLLM must still force-kill an engine core (it did not end within its grace), the core and
its workers first dump every thread's stack to their logs (faulthandler on SIGUSR1), so the
step it hung in can be read from one log.
"""

from __future__ import annotations

import faulthandler
import functools
import gc
import os
import signal
import sys
import threading
import time
from typing import NoReturn

ENV = "MMHANDOFF_FAST_EXIT"
SLOW_TEARDOWN_S = 3.0  # a teardown still running then dumps its stacks to the log


def enabled() -> bool:
    value = os.environ.get(ENV, "on")
    if value not in ("on", "default"):
        raise ValueError(f"{ENV} must be 'on' or 'default', got {value!r}")
    return value == "on"


def _no_collect(generation: int = 2) -> int:
    return 0


def _exit_status(code) -> int:
    """The status the interpreter would exit with for `sys.exit(code)`."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


def end_process(code=None) -> NoReturn:
    """End this process now, as a fork-started child ends: streams flushed, no interpreter
    finalization (and so none of its garbage collection)."""
    status = _exit_status(code)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (AttributeError, OSError, ValueError):
            pass
    os._exit(status)


def leave_without_finalizing() -> None:
    """From now on, `sys.exit` in the main thread ends the process at once (`end_process`):
    `multiprocessing` calls it (spawn_main) only after its own exit steps. Other threads keep
    the normal `sys.exit`, which ends only that thread."""
    normal_exit = sys.exit

    def exit_now(code=None):
        if threading.current_thread() is not threading.main_thread():
            normal_exit(code)
        end_process(code)

    sys.exit = exit_now


def unlink_own_rings() -> None:
    """Unlink the shared-memory rings this process created. vLLM unlinks them only in
    `ShmRingBuffer.__del__`, which the skipped collection or finalization would have run;
    without it the resource tracker unlinks them later and warns of a leak."""
    from vllm.distributed.device_communicators.shm_broadcast import ShmRingBuffer

    gc.unfreeze()  # vLLM may have frozen them at start-up: get_objects does not list those
    # `type(o) is`, not isinstance: that reads `__class__`, which makes lazy modules import
    for ring in [o for o in gc.get_objects() if type(o) is ShmRingBuffer]:
        if getattr(ring, "is_creator", False) and hasattr(ring, "shared_memory"):
            ring.is_creator = False  # its __del__, if it still runs, only closes
            ring.shared_memory.close()
            try:
                ring.shared_memory.unlink()
            except FileNotFoundError:
                pass


def final_teardown(shutdown):
    """`shutdown` of a process that ends right after it: no full collections during it, no
    finalization after it."""

    @functools.wraps(shutdown)
    def teardown(self, *args, **kwargs):
        if threading.current_thread() is threading.main_thread():
            # vLLM's engine core restores SIGTERM's default action before its teardown: a
            # second SIGTERM (from a user's `kill` of the process group) would end it half-way.
            for sig in (signal.SIGTERM, signal.SIGINT):
                signal.signal(sig, signal.SIG_IGN)
        collect, gc.collect = gc.collect, _no_collect
        faulthandler.dump_traceback_later(SLOW_TEARDOWN_S)  # where a slow one spends its time
        try:
            return shutdown(self, *args, **kwargs)
        finally:
            faulthandler.cancel_dump_traceback_later()
            gc.collect = collect
            unlink_own_rings()
            leave_without_finalizing()

    teardown.mmhandoff_fast_exit = True
    return teardown


DUMP_SIGNAL = signal.SIGUSR1


def _dump_before_kill(kill):
    """vLLM's force kill of an engine core that did not end in its grace: first every thread's
    stack of the core and its workers goes to their logs (faulthandler, installed in each), so a
    hang in a teardown can be found from one log."""

    @functools.wraps(kill)
    def dump_then_kill(pid: int, *args, **kwargs):
        import psutil

        try:
            procs = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
        except psutil.Error:
            procs = []
        for p in procs:
            try:
                p.send_signal(DUMP_SIGNAL)
            except psutil.Error:
                pass
        if procs:
            time.sleep(0.5)  # they write their stacks
        return kill(pid, *args, **kwargs)

    dump_then_kill.mmhandoff_fast_exit = True
    return dump_then_kill


def install() -> None:
    """Patch the teardown of vLLM's engine-core and worker process classes (idempotent)."""
    if not enabled():
        return
    if threading.current_thread() is threading.main_thread():
        faulthandler.register(DUMP_SIGNAL, all_threads=True)
    import vllm.v1.utils as v1_utils

    if not getattr(v1_utils.kill_process_tree, "mmhandoff_fast_exit", False):
        v1_utils.kill_process_tree = _dump_before_kill(v1_utils.kill_process_tree)
    # Both classes run only in vLLM's own child processes (an in-process engine is an
    # EngineCore), and each calls `shutdown` once, in its process's last steps.
    from vllm.v1.engine.core import EngineCoreProc
    from vllm.v1.executor.multiproc_executor import WorkerProc

    for cls in (EngineCoreProc, WorkerProc):
        if not getattr(cls.shutdown, "mmhandoff_fast_exit", False):
            cls.shutdown = final_teardown(cls.shutdown)
