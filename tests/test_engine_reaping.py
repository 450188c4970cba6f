"""vLLM's engine-core process manager, stopping a core that its monitor thread reaps first.

The interleaving behind rare unclean graph stops in CI (an engine core "force killed" ~0.3 s after
the stop began, though it had ended cleanly) is forced here: the monitor thread's `waitpid` reaps
the ended core and is held there before it stores the exit code; the stopping thread's `waitpid`
then finds no child. vLLM's own `shutdown` and `monitor_engine_liveness` run unchanged.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import os
import signal
import threading
import time
from types import SimpleNamespace

import pytest

from mmhandoff.vllm_adapter.reaping import serialize_reaping

pytestmark = pytest.mark.engine  # vLLM's process manager: the engine tier has vLLM loaded


def _core() -> None:
    signal.pause()  # SIGTERM ends it


@pytest.mark.parametrize("serialized", [False, True])
def test_an_engine_core_reaped_by_the_monitor_is_not_force_killed(monkeypatch, serialized):
    import vllm.v1.utils
    from vllm.v1.engine.utils import CoreEngineProcManager

    proc = multiprocessing.get_context("fork").Process(target=_core, name="EngineCore")
    proc.start()
    if serialized:
        serialize_reaping([proc])
    real_waitpid = os.waitpid
    monitor_reaped = threading.Event()

    def waitpid(pid, flag):
        if threading.current_thread() is threading.main_thread():
            return real_waitpid(pid, flag)
        # the monitor: once the core is a zombie, reap it; then be preempted for a while
        deadline = time.monotonic() + 5
        while not _zombie(pid) and time.monotonic() < deadline:
            time.sleep(0.01)
        out = real_waitpid(pid, flag)
        monitor_reaped.set()
        time.sleep(0.3)
        return out

    real_wait = multiprocessing.connection.wait
    monitor_waits = threading.Event()

    def wait(objects, timeout=None):
        if threading.current_thread() is not threading.main_thread():
            monitor_waits.set()
            return real_wait(objects, timeout)
        ready = real_wait(objects, timeout)
        if ready:  # the core ended: the stopping thread looks at it after the monitor
            monitor_reaped.wait(timeout=5)
        return ready

    killed = []
    monkeypatch.setattr(os, "waitpid", waitpid)
    monkeypatch.setattr(multiprocessing.connection, "wait", wait)
    monkeypatch.setattr(vllm.v1.utils, "kill_process_tree", killed.append)
    manager = SimpleNamespace(processes=[proc], manager_stopped=threading.Event(),
                              shutdown=lambda: None)
    monitor = threading.Thread(target=CoreEngineProcManager.monitor_engine_liveness,
                               args=(manager,), daemon=True)
    monitor.start()
    assert monitor_waits.wait(timeout=5)  # as in a running engine: the monitor is watching
    manager.manager_stopped.set()  # as CoreEngineProcManager.shutdown does first
    vllm.v1.utils.shutdown([proc], timeout=5)
    monitor.join(timeout=5)

    assert monitor_reaped.is_set()  # the interleaving happened
    assert proc.exitcode == -signal.SIGTERM
    if serialized:
        assert killed == []
    else:  # what the lock prevents: a SIGKILL sent to the pid of a process already gone
        assert killed == [proc.pid]


def _zombie(pid: int) -> bool:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] == "Z"
