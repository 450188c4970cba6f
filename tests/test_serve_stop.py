"""serve's stop, with stand-in processes (no engine): each replica is signalled alone and stops
what it started itself, so an engine process gets one SIGTERM (from its replica), never a
second one from serve. vLLM's engine core restores SIGTERM's default action for its teardown:
a second SIGTERM there killed it half-way (its shared memory leaked, or vLLM force-killed it).
The same on real graphs: every graph test's stop checks the log for both."""

from __future__ import annotations

import sys
import textwrap

import pytest

from mmhandoff.serving import supervisor
from mmhandoff.serving.graph import Component

pytestmark = pytest.mark.unit

# The stand-in engine process: counts the SIGTERMs it gets and ends once its replica says it
# has signalled it (so a signal from serve, before or after, is counted too).
ENGINE = textwrap.dedent("""
    import os, signal, sys, time
    log, signalled = sys.argv[1], sys.argv[2]
    signal.signal(signal.SIGTERM, lambda *_: open(log, "a").write("SIGTERM\\n"))
    open(log, "a").write("up\\n")
    while not os.path.exists(signalled):
        time.sleep(0.01)
""")

# The stand-in replica: on SIGTERM it stops its engine process, as a worker stops its engine.
REPLICA = textwrap.dedent("""
    import pathlib, signal, subprocess, sys, time
    engine_py, log, signalled = sys.argv[1:4]
    engine = subprocess.Popen([sys.executable, engine_py, log, signalled])
    def stop(*_):
        engine.send_signal(signal.SIGTERM)
        pathlib.Path(signalled).touch()
        sys.exit(engine.wait())
    signal.signal(signal.SIGTERM, stop)
    while True:
        time.sleep(1)
""")


def _lines(path) -> list[str]:
    return path.read_text().split() if path.exists() else []


def test_an_engine_process_gets_one_sigterm_at_a_graph_stop(monkeypatch, tmp_path):
    (tmp_path / "engine.py").write_text(ENGINE)
    (tmp_path / "replica.py").write_text(REPLICA)
    log, signalled = tmp_path / "engine.log", tmp_path / "signalled"
    monkeypatch.setattr(supervisor.Supervisor, "command", lambda self, c: [
        sys.executable, str(tmp_path / "replica.py"), str(tmp_path / "engine.py"), str(log),
        str(signalled)])
    s = supervisor.Supervisor(Component("router", engine=False).reachable(), {}, port=None)
    s.start()
    try:
        (replica,) = s.replicas
        for _ in range(1000):  # the engine process is up and handles SIGTERM
            if _lines(log) or replica.proc.poll() is not None:
                break
            supervisor.time.sleep(0.01)
        assert _lines(log) == ["up"]
        s.stop()
        assert replica.proc.returncode == 0
        assert _lines(log) == ["up", "SIGTERM"]  # one, from its replica
        assert not supervisor._session_procs(replica.proc.pid)
    finally:
        for r in s.replicas:
            supervisor._kill_session(r.proc.pid)
            r.proc.wait()
