"""serve's replica restarts, with stand-in processes (no engine): a dead replica of a component
that has several is started again after a backoff, at most MAX_RESTARTS times in a row; the only
replica of a component, or one out of restarts, ends the graph. The same on a real graph, a
decode replica killed under load, is in tests/test_graphs.py."""

from __future__ import annotations

import os
import shutil
import signal
import sys
import time

import pytest

from mmhandoff.serve import supervisor
from mmhandoff.serve.graph import Component

pytestmark = pytest.mark.unit


@pytest.fixture
def sup(monkeypatch, tmp_path):
    monkeypatch.setattr(supervisor, "BACKOFF_S", (0.1, 0.2))
    monkeypatch.setattr(supervisor.Supervisor, "command",
                        lambda self, c: [sys.executable, "-c", "import time; time.sleep(120)"])
    frontend = Component("frontend", engine=False)
    frontend.link(Component("router", engine=False))
    config = {"components": {"router": {"replicas": 2}}}
    s = supervisor.Supervisor(frontend.reachable(), config, port=None)
    s.start()
    yield s
    for r in s.replicas:
        supervisor._end_session(r.proc.pid, grace_s=1)
        r.proc.wait()
    shutil.rmtree(s.run_dir)  # what Supervisor.stop does last


def _kill(s, name: str) -> int:
    (r,) = [r for r in s.replicas if r.name == name]
    os.kill(r.proc.pid, signal.SIGKILL)
    r.proc.wait()
    return r.proc.pid


def _tend_until(s, done, within_s: float = 10.0):
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        fatal = s.tend()
        if done(fatal):
            return fatal
        time.sleep(0.02)
    states = [(r.name, r.proc.poll()) for r in s.replicas]
    raise AssertionError(f"not done in {within_s} s: {states}")


def _pid(s, name: str) -> int:
    return next(r.proc.pid for r in s.replicas if r.name == name)


def test_a_dead_replica_is_restarted_then_given_up_on(sup, mmhandoff_log):
    assert [r.name for r in sup.replicas] == ["router-0", "router-1", "frontend-0"]
    for attempt in range(1, supervisor.MAX_RESTARTS + 1):
        old = _kill(sup, "router-0")
        t0 = time.monotonic()
        assert _tend_until(sup, lambda fatal: _pid(sup, "router-0") != old) == []
        backoff = supervisor.BACKOFF_S[min(attempt - 1, len(supervisor.BACKOFF_S) - 1)]
        assert time.monotonic() - t0 >= backoff  # not at once: after the backoff
        assert all(r.proc.poll() is None for r in sup.replicas)  # the others untouched
        assert "router-0 died (killed by signal 9); restarting it in" in mmhandoff_log.text
        mmhandoff_log.clear()
    _kill(sup, "router-0")  # out of restarts: the graph ends, naming it
    assert _tend_until(sup, bool) == [("router-0", -9)]


def test_the_only_replica_of_a_component_ends_the_graph(sup):
    _kill(sup, "frontend-0")
    assert _tend_until(sup, bool) == [("frontend-0", -9)]


def test_restarts_are_forgiven_after_a_steady_run(sup, monkeypatch):
    old = _kill(sup, "router-0")
    _tend_until(sup, lambda fatal: _pid(sup, "router-0") != old)
    (r,) = [r for r in sup.replicas if r.name == "router-0"]
    assert r.restarts == 1
    monkeypatch.setattr(supervisor, "STEADY_S", 0.0)
    sup.tend()
    assert r.restarts == 0
