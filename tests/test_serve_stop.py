"""serve's stop, with stand-in processes (no engine): serve signals only the roots of each
replica's session (the replica while it lives, else what it left), and each process stops its
own children. So an engine process gets one SIGTERM, from its replica, and its model worker
none: vLLM's engine core restores SIGTERM's default action for its teardown, where a second one
killed it half-way (its shared memory leaked), and one whose worker was signalled too could wait
out its grace for it. Every graph test's stop checks the same on real engines (graph_runner)."""

from __future__ import annotations

import os
import signal
import sys
import textwrap
import time

import pytest

from mmhandoff.serve import supervisor
from mmhandoff.serve.graph import Component

pytestmark = pytest.mark.unit

# The stand-ins, each logging the SIGTERMs it gets: a replica starts an engine process, which
# starts a model worker. The replica stops its engine with SIGTERM; the engine stops its worker
# through a file (as vLLM's core closes a pipe) and ends after it.
REPLICA = textwrap.dedent("""
    import os, signal, subprocess, sys, time
    log_dir = sys.argv[1]
    engine = subprocess.Popen([sys.executable, os.path.join(os.path.dirname(__file__), "engine.py"), log_dir])
    def stop(*_):
        open(log_dir + "/replica", "a").write("SIGTERM\\n")
        engine.send_signal(signal.SIGTERM)
        sys.exit(engine.wait())
    signal.signal(signal.SIGTERM, stop)
    while True:
        time.sleep(1)
""")
ENGINE = textwrap.dedent("""
    import os, pathlib, signal, subprocess, sys, time
    log_dir = sys.argv[1]
    worker = subprocess.Popen([sys.executable, os.path.join(os.path.dirname(__file__), "worker.py"), log_dir])
    def stop(*_):
        open(log_dir + "/engine", "a").write("SIGTERM\\n")
        pathlib.Path(log_dir, "stop-worker").touch()
        sys.exit(worker.wait())
    signal.signal(signal.SIGTERM, stop)
    while True:
        time.sleep(1)
""")
WORKER = textwrap.dedent("""
    import os, signal, sys, time
    log_dir = sys.argv[1]
    signal.signal(signal.SIGTERM, lambda *_: open(log_dir + "/worker", "a").write("SIGTERM\\n"))
    open(log_dir + "/up", "w").close()
    while not os.path.exists(log_dir + "/stop-worker"):
        time.sleep(0.01)
""")


@pytest.fixture
def graph(monkeypatch, tmp_path):
    for name, text in (("replica", REPLICA), ("engine", ENGINE), ("worker", WORKER)):
        (tmp_path / f"{name}.py").write_text(text)
    monkeypatch.setattr(supervisor.Supervisor, "command", lambda self, c: [
        sys.executable, str(tmp_path / "replica.py"), str(tmp_path)])
    s = supervisor.Supervisor(Component("router", engine=False).reachable(), {}, port=None)
    s.start()
    deadline = time.monotonic() + 30
    while not (tmp_path / "up").exists():  # the whole tree is up, handlers installed
        assert time.monotonic() < deadline and s.replicas[0].proc.poll() is None
        time.sleep(0.01)
    yield s
    for r in s.replicas:
        supervisor._kill_session(r.proc.pid)
        r.proc.wait()


def _sigterms(tmp_path) -> dict[str, int]:
    return {name: (tmp_path / name).read_text().count("SIGTERM") if (tmp_path / name).exists()
            else 0 for name in ("replica", "engine", "worker")}


def test_a_replica_stops_its_own_engine(graph, tmp_path):
    graph.stop()
    (replica,) = graph.replicas
    assert replica.proc.returncode == 0
    assert _sigterms(tmp_path) == {"replica": 1, "engine": 1, "worker": 0}
    assert not supervisor._session_procs(replica.proc.pid)


def test_the_engine_a_dead_replica_left_is_stopped_once(graph, tmp_path):
    (replica,) = graph.replicas
    os.kill(replica.proc.pid, signal.SIGKILL)
    replica.proc.wait()
    graph.stop()
    assert _sigterms(tmp_path) == {"replica": 0, "engine": 1, "worker": 0}
    assert not supervisor._session_procs(replica.proc.pid)
