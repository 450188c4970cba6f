"""The fast_exit plugin's teardown, in a process of its own (it ends the process it runs in).

The end-to-end check is in tests/graph_runner.py: every graph the tests stop must leave no engine
force-killed and no shared memory behind.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.engine  # vLLM's shm ring in a process of its own

ROOT = Path(__file__).resolve().parents[1]

# A stand-in for vLLM's EngineCoreProc/WorkerProc: it owns a real vLLM shm ring, and its
# shutdown reports what it sees while the wrapped teardown runs.
SCRIPT = r"""
import atexit, gc, os, signal, sys, threading, weakref
from vllm.distributed.device_communicators.shm_broadcast import ShmRingBuffer
from mmhandoff.vllm_adapter.plugins.fast_exit import final_teardown

class Proc:
    def __init__(self):
        self.ring = ShmRingBuffer(n_reader=1, max_chunk_bytes=1024, max_chunks=2)

    def shutdown(self):
        class Cycle: pass
        garbage = Cycle(); garbage.me = garbage; ref = weakref.ref(garbage); del garbage
        gc.collect()
        print("collected during teardown:", ref() is None)
        print("SIGTERM ignored during teardown:", signal.getsignal(signal.SIGTERM) == signal.SIG_IGN)
        return "done"

proc = Proc()
path = "/dev/shm/" + proc.ring.shared_memory.name
print("ring exists before:", os.path.exists(path))
collect = gc.collect
Proc.shutdown = final_teardown(Proc.shutdown)
print("result:", proc.shutdown())
print("gc.collect restored:", gc.collect is collect)
print("ring exists after:", os.path.exists(path))
thread = threading.Thread(target=sys.exit, args=(5,))
thread.start(); thread.join()
print("sys.exit in a thread ended only the thread")
atexit.register(print, "ATEXIT RAN")
print("last words", end="")
sys.exit(7)
"""


def test_teardown_skips_collection_unlinks_its_rings_and_ends_the_process():
    done = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, capture_output=True,
                          text=True, timeout=180,
                          env={**os.environ, "VLLM_LOGGING_LEVEL": "WARNING"})
    out = done.stdout
    assert done.returncode == 7, (out, done.stderr[-3000:])
    for line in ("ring exists before: True",
                 "collected during teardown: False",  # gc.collect was a no-op
                 "SIGTERM ignored during teardown: True",
                 "result: done",
                 "gc.collect restored: True",
                 "ring exists after: False",  # unlinked although never collected
                 "sys.exit in a thread ended only the thread"):
        assert line in out, (line, out)
    assert out.endswith("last words")  # flushed before the process ended
    assert "ATEXIT RAN" not in out  # ended without the interpreter's finalization
    assert "leaked" not in done.stderr  # the resource tracker found nothing to clean


def test_setting(monkeypatch):
    from mmhandoff.vllm_adapter.plugins import fast_exit

    monkeypatch.delenv(fast_exit.ENV, raising=False)
    assert fast_exit.enabled()
    monkeypatch.setenv(fast_exit.ENV, "default")
    assert not fast_exit.enabled()
    monkeypatch.setenv(fast_exit.ENV, "off")
    with pytest.raises(ValueError, match=fast_exit.ENV):
        fast_exit.enabled()


STUCK = r"""
import faulthandler, signal, sys, time
faulthandler.register(signal.SIGUSR1, all_threads=True)
def stuck_in_its_teardown():
    print("up", flush=True)
    time.sleep(120)
stuck_in_its_teardown()
"""


def test_an_engine_core_is_made_to_dump_its_stacks_before_vllm_kills_it():
    from mmhandoff.vllm_adapter.plugins import fast_exit

    stuck = subprocess.Popen([sys.executable, "-c", STUCK], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    try:
        assert stuck.stdout.readline() == "up\n"  # its handler is installed
        killed = []
        fast_exit._dump_before_kill(lambda pid: (killed.append(pid), stuck.kill()))(stuck.pid)
        assert killed == [stuck.pid]
        assert "in stuck_in_its_teardown" in stuck.communicate(timeout=30)[1]
    finally:
        stuck.kill()
        stuck.wait()
