"""`mmhandoff serve graphs.<graph>:<Component> -f configs/<graph>.yaml`: run a graph on one host.

Starts every component reachable from the named one (callees first), each replica as its own
`python -m mmhandoff.<module>` process in its own process group, with the YAML's arguments and
environment; prefixes their output with `[module-i]`; shows which replicas are still starting
until every one reports ready (workers and the router on Dynamo's system status server, at a free
`DYN_SYSTEM_PORT` each; the frontend on its /health). On Ctrl-C or SIGTERM, and when any
component dies (its name and exit code are printed; 3 means its engine died), it stops them
callers first, each stage after the previous one exited: the frontend finishes the requests it
has in flight while the workers still serve them, then the workers go (SIGTERM to each replica,
which stops its own engine; for a dead replica, to the engine processes it left; serve waits for
the replica's session to empty, so they and Python's resource tracker unlink their shared memory;
SIGKILL to whatever is left after a grace period). It exits 0 on a requested stop, 1 when a
component died.

Once the graph is ready, a dead replica of a component with several replicas is restarted (the
others serve meanwhile; the frontend retries or ends the requests it had in flight there): after
1, 4, then 16 s, at most MAX_RESTARTS times in a row (a replica up for STEADY_S is forgiven its
earlier restarts); then serve gives up and stops the graph with exit 1. The only replica of a
component is not restarted: a graph that lost a part says so instead of limping on.

Discovery is a fresh file folder per run and requests go over TCP, unless the YAML names
`etcd: <url>` (discovery through etcd) and/or `nats: <url>` (requests over NATS); with
`tls: {ca, cert, key}` every plane that can leave the host is mutual TLS (plane.tls). NIXL
side-channel ports are picked free per replica.
"""

from __future__ import annotations

import importlib
import logging
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import dataclass
from typing import Mapping
from pathlib import Path

from mmhandoff.plane.handoff_keys import KEY_ENV, KEY_FILE_ENV
from mmhandoff.plane.ports import free_port
from mmhandoff.plane.tls import TlsConfigError, tls_env
from mmhandoff.process.health import ENGINE_DEAD, free_system_port
from mmhandoff.serve.gpus import PlacementError, Slot, place, share_args, visible_gpus
from mmhandoff.serve.graph import Component

log = logging.getLogger(__name__)

GRACE_S = 60.0  # for the whole stop: long enough for in-flight answers to finish
END_GRACE_S = 20.0  # for a dead replica's engine processes; an engine's own stop takes <= 15 s


class GraphError(ValueError):
    pass


def load_graph(target: str, cwd: str | None = None):
    """The components `target` ("graphs.<graph>:<Component>") reaches, callees first.

    Like `python -m`, the working directory comes first: a user's own `graphs/<graph>.py` (or a
    checkout's) is found there. A `graphs.<graph>` that is not there is the built-in
    `mmhandoff.graphs.<graph>`. Any other module path is imported as it is."""
    module_name, _, attr = target.partition(":")
    if not attr or not module_name:
        raise GraphError(f"expected graphs.<graph>:<Component>, got {target!r}")
    cwd = cwd or os.getcwd()
    if cwd not in sys.path:
        sys.path.insert(0, cwd)
    try:
        module = _import_graph(module_name)
        component = getattr(module, attr)
    except (ImportError, AttributeError) as e:
        raise GraphError(f"cannot load {target!r}: {e}") from None
    if not isinstance(component, Component):
        raise GraphError(f"{target!r} is a {type(component).__name__}, not a graph Component")
    return component.reachable()


def _import_graph(module_name: str):
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        first, _, rest = module_name.partition(".")
        # only "graphs" or "graphs.<graph>" itself missing falls back, not an import inside it
        if first != "graphs" or not rest or e.name not in ("graphs", module_name):
            raise
    return importlib.import_module(f"mmhandoff.graphs.{rest}")


def load_config(path: str) -> dict:
    import yaml

    try:
        config = yaml.safe_load(Path(path).read_text()) or {}
    except (OSError, yaml.YAMLError) as e:
        raise GraphError(f"cannot read config {path!r}: {e}") from None
    if not isinstance(config, dict) or not isinstance(config.get("components", {}), dict):
        raise GraphError(f"{path}: expected a mapping with a 'components' mapping")
    for name, spec in config.get("components", {}).items():
        spec = spec or {}
        replicas = spec.get("replicas", 1)
        if not isinstance(replicas, int) or replicas < 1:
            raise GraphError(f"{path}: {name}.replicas must be an integer >= 1")
        if not isinstance(spec.get("args", []), list):
            raise GraphError(f"{path}: {name}.args must be a list")
    return config


def check_config(components, config: dict, config_path: str, target: str) -> None:
    """The YAML configures only components the graph reaches, and wires nothing: endpoints come
    from the graph's links alone."""
    unknown = set(config.get("components", {})) - {c.module for c in components}
    if unknown:
        raise GraphError(f"{config_path} configures {sorted(unknown)}, which {target} does not "
                         f"reach ({', '.join(c.module for c in components)})")
    for c in components:
        args = [str(a) for a in ((config.get("components") or {}).get(c.module) or {})
                .get("args", [])]
        for role in c.wiring():
            if any(a == f"--{role}" or a.startswith(f"--{role}=") for a in args):
                raise GraphError(f"{config_path}: {c.module}.args sets --{role}, which the "
                                 f"graph wires from its links ({target}); remove it")


def runtime_env(config: dict) -> dict[str, str]:
    """Where the components find each other: files (default), or the YAML's etcd and NATS; and
    with the YAML's `tls`, TLS on each plane (plane.tls)."""
    env = {}
    if config.get("etcd"):
        env.update(ETCD_ENDPOINTS=str(config["etcd"]), MMHANDOFF_DISCOVERY="etcd")
    if config.get("nats"):
        env.update(NATS_SERVER=str(config["nats"]), MMHANDOFF_REQUEST_PLANE="nats")
    if config.get("tls") is not None:
        try:
            env.update(tls_env(config["tls"], etcd=config.get("etcd"), nats=config.get("nats")))
        except TlsConfigError as e:
            raise GraphError(str(e)) from None
    return env


def graph_env(config: dict, base: Mapping[str, str], run_dir: Path) -> dict[str, str]:
    """The environment every process of a graph run starts with."""
    # TMPDIR: what the graph's processes leave in the temp dir (a killed replica's socket files)
    # goes with the run's directory when serve stops
    env = dict(base, DYN_FILE_KV=str(run_dir / "discovery"), TMPDIR=str(run_dir / "tmp"),
               **runtime_env(config),
               **{k: str(v) for k, v in (config.get("env") or {}).items()})
    if not (env.get(KEY_ENV) or env.get(KEY_FILE_ENV)):
        # Handoffs are signed: one fresh key per graph run, shared by its processes only (they
        # inherit it; nothing writes it down).
        env[KEY_ENV] = secrets.token_hex(32)
    return env


def _arg(args: list[str], flag: str, default: str) -> str:
    return args[args.index(flag) + 1] if flag in args[:-1] else default


@dataclass
class Replica:
    name: str  # module-i
    module: str
    proc: subprocess.Popen
    health_url: str  # 200 once ready
    component: Component
    index: int
    started: float  # time.monotonic() of its (re)start
    restarts: int = 0  # in a row: reset once it stayed up for STEADY_S
    restart_at: float | None = None  # when a dead replica is started again


MAX_RESTARTS = 3  # in a row, per replica; then serve gives up and stops the graph
BACKOFF_S = (1.0, 4.0, 16.0)  # before the 1st, 2nd, 3rd restart in a row
STEADY_S = 300.0  # a replica up this long has its restarts forgiven


class Supervisor:
    def __init__(self, components, config: dict, port: int | None) -> None:
        self.components, self.config = components, config
        self.port_override = port
        self.replicas: list[Replica] = []
        self.stopping = False
        # each engine replica's GPU and share (gpus.py); refused here, before anything starts
        engines = [(c.module, self.replica_count(c),
                    self.config.get("components", {}).get(c.module) or {})
                   for c in components if c.engine]
        try:
            self.slots: dict[str, Slot] = place(engines, visible_gpus(
                {**os.environ, **{k: str(v) for k, v in (config.get("env") or {}).items()}}))
        except PlacementError as e:
            raise GraphError(str(e)) from None
        self.pending: list[tuple[Component, int]] = []  # replicas waiting for their GPU
        self.ready: set[str] = set()
        self.run_dir = Path(tempfile.mkdtemp(prefix="mmhandoff-run-"))

    def command(self, component) -> list[str]:
        spec = self.config.get("components", {}).get(component.module) or {}
        args = [str(a) for a in spec.get("args", [])]
        args += ["--namespace", str(self.config.get("namespace", "mmhandoff"))]
        if component.module == "frontend" and self.port_override:
            args += ["--port", str(self.port_override)]
        if component.engine:
            if self.config.get("model"):
                args += ["--model", str(self.config["model"])]
            args += ["--nixl-port", str(free_port())]
        for role, endpoint in component.wiring().items():  # the graph's links, nothing else
            args += [f"--{role}", endpoint or "none"]
        return [sys.executable, "-m", f"mmhandoff.{component.module}", *args]

    def start(self) -> None:
        self.env = graph_env(self.config, os.environ, self.run_dir)
        Path(self.env["TMPDIR"]).mkdir(exist_ok=True)
        for name, slot in self.slots.items():
            log.info(f"[serve] {name}: GPU {slot.gpu}"
                     + (f", {slot.share:.2f} of its memory" if slot.share is not None else "")
                     + (f", starts once {', '.join(slot.shared_with)} is ready"
                        if slot.shared_with else ""))
        self.pending = [(c, i) for c in self.components for i in range(self.replica_count(c))]
        self.start_due()

    def start_due(self) -> None:
        """Start the pending replicas whose GPU has no other engine still starting (vLLM sizes
        an engine's KV cache from the memory free meanwhile)."""
        for component, i in list(self.pending):
            slot = self.slots.get(f"{component.module}-{i}")
            if slot is not None and not all(n in self.ready for n in slot.shared_with):
                continue
            self.pending.remove((component, i))
            self.replicas.append(self._launch(component, i))

    def replica_count(self, component) -> int:
        spec = self.config.get("components", {}).get(component.module) or {}
        return int(spec.get("replicas", 1))

    def _launch(self, component, i: int) -> Replica:
        spec = self.config.get("components", {}).get(component.module) or {}
        name = f"{component.module}-{i}"
        own = {k: str(v) for k, v in (spec.get("env") or {}).items()}
        if component.module != "frontend":  # Dynamo's system status server: /health is 200
            # once the worker is ready. One port per replica, always serve's choice (a YAML
            # value would collide).
            own["DYN_SYSTEM_PORT"] = str(free_system_port())
        command = self.command(component)
        if (slot := self.slots.get(name)) is not None:
            own["CUDA_VISIBLE_DEVICES"] = slot.gpu
            command += share_args(spec, slot)
        command, env, address = self.placed(component, command, {**self.env, **own})
        health = (self.frontend_url() + "/health" if component.module == "frontend"
                  else f"http://{address}:{own['DYN_SYSTEM_PORT']}/health")
        proc = subprocess.Popen(command, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True)
        threading.Thread(target=self._relay, args=(name, proc), daemon=True).start()
        log.info(f"[serve] started {name} (pid {proc.pid}, health {health})")
        return Replica(name, component.module, proc, health, component, i, time.monotonic())

    def placed(self, component, command: list[str], env: dict[str, str]):
        """Where a replica runs: (command, environment, the address its health server answers
        on). Here: this host, loopback. A harness that spreads a graph over hosts overrides it."""
        return command, env, "127.0.0.1"

    def answers(self, url: str) -> bool:
        """Whether `url` answers 200 (a replica's health), asked from where serve runs."""
        return _answers(url)

    def tend(self) -> list[tuple[str, int]]:
        """Once ready: restart dead replicas of components that have several (the others carry
        the load meanwhile), with backoff, at most MAX_RESTARTS in a row each. Returns the
        deaths that end the graph: the only replica of a component, or one out of restarts."""
        fatal, now = [], time.monotonic()
        for n, r in enumerate(self.replicas):
            if r.proc.poll() is None:
                if r.restarts and now - r.started > STEADY_S:
                    r.restarts = 0
                continue
            if self.replica_count(r.component) < 2 or r.restarts >= MAX_RESTARTS:
                fatal.append((r.name, r.proc.returncode))
            elif r.restart_at is None:
                r.restart_at = now + BACKOFF_S[min(r.restarts, len(BACKOFF_S) - 1)]
                log.warning(f"[serve] {r.name} died ({_exit(r.proc.returncode)}); restarting it "
                            f"in {r.restart_at - now:.0f} s (restart {r.restarts + 1} of "
                            f"{MAX_RESTARTS}); its other replicas serve meanwhile")
            elif now >= r.restart_at:
                _end_session(r.proc.pid)  # its engine processes may outlive it
                fresh = self._launch(r.component, r.index)
                fresh.restarts = r.restarts + 1
                self.replicas[n] = fresh
        return fatal

    def _relay(self, name: str, proc: subprocess.Popen) -> None:
        for line in proc.stdout:
            sys.stdout.write(f"[{name}] {line}")
            sys.stdout.flush()

    def frontend_url(self) -> str:
        spec = self.config.get("components", {}).get("frontend") or {}
        port = self.port_override or _arg([str(a) for a in spec.get("args", [])], "--port", "8000")
        return f"http://127.0.0.1:{port}"

    def wait_ready(self, stop_requested, timeout_s: float = 900) -> bool:
        t0, last = time.monotonic(), 0.0
        while time.monotonic() - t0 < timeout_s and not self.dead() and not stop_requested():
            for r in self.replicas:
                if r.name not in self.ready and self.answers(r.health_url):
                    self.ready.add(r.name)
            self.start_due()
            waiting = [r.name for r in self.replicas if r.name not in self.ready] + [
                f"{c.module}-{i} (queued for its GPU)" for c, i in self.pending]
            if not waiting:
                log.info(f"[serve] ready: {self.frontend_url()}/v1 "
                         f"({time.monotonic() - t0:.0f} s)")
                return True
            if time.monotonic() - last > 15:
                last = time.monotonic()
                log.info(f"[serve] starting ... {time.monotonic() - t0:.0f} s; waiting for "
                         f"{', '.join(waiting)}")
            time.sleep(0.5)
        return False

    def dead(self) -> list[tuple[str, int]]:
        return [(r.name, r.proc.returncode) for r in self.replicas if r.proc.poll() is not None]

    def stop(self) -> None:
        """Callers first (the reverse of the start order), one component at a time: each stage
        drains before the components it calls go away."""
        self.stopping = True
        deadline = time.monotonic() + GRACE_S
        stages = [[r for r in self.replicas if r.module == c.module]
                  for c in reversed(self.components)]
        for stage in stages:
            for r in stage:  # a replica that died too: its engine processes may live on
                _signal_roots(r.proc.pid, signal.SIGTERM)
            for r in stage:
                try:
                    r.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    log.warning(f"[serve] {r.name} did not stop in {GRACE_S:.0f} s: killing it")
                    continue
                _await_session(r.proc.pid, deadline)
        for r in self.replicas:  # the whole session: engine cores and workers included
            _kill_session(r.proc.pid)
            r.proc.wait()
        shutil.rmtree(self.run_dir, ignore_errors=True)  # discovery files, the replicas' TMPDIR


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass


def _signal_roots(sid: int, sig: int) -> None:
    """`sig` to the processes of a replica's session whose parent is not in it: the replica
    itself while it lives, else what it left (its engine cores; its resource tracker, which
    ignores SIGTERM). Each stops its own children: an engine core whose model worker also got a
    signal of its own may wait out its grace for it; one signalled again during its teardown,
    after vLLM restored SIGTERM's default action there, dies half-way (its shared memory
    leaked)."""
    import psutil

    procs = _session_procs(sid)
    pids = {p.pid for p in procs}
    for p in procs:
        try:
            if p.ppid() not in pids:
                p.send_signal(sig)
        except psutil.Error:  # gone meanwhile
            pass


def _end_session(sid: int, grace_s: float = END_GRACE_S) -> None:
    """What a dead replica left in its session (engine cores, workers) goes: SIGTERM, time to
    stop their workers and unlink their shared memory, then SIGKILL."""
    _signal_roots(sid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while _session_procs(sid) and time.monotonic() < deadline:
        time.sleep(0.05)
    _kill_session(sid)


def _await_session(sid: int, deadline: float, nudge_after_s: float = 5.0) -> None:
    """After a replica's main process ended: what it started (engine processes, Python's
    resource tracker) unlinks its shared memory on the way out; let it, instead of killing it
    half-way. Engine processes a replica left running (it died, or ended without stopping its
    engine) get SIGTERM after `nudge_after_s`."""
    nudge_at = time.monotonic() + nudge_after_s
    while _session_procs(sid) and time.monotonic() < deadline:
        if nudge_at is not None and time.monotonic() >= nudge_at:
            _signal_roots(sid, signal.SIGTERM)
            nudge_at = None
        time.sleep(0.05)


def _exit(rc: int) -> str:
    if rc < 0:
        return f"killed by signal {-rc}"
    return f"exit {rc}{', its engine died' if rc == ENGINE_DEAD else ''}"


def _session_procs(sid: int) -> list:
    """The processes of a replica's session that still run (a zombie does not: its parent reaps
    it). Each replica leads its own session; a descendant that made its own process group is
    still in it."""
    import psutil

    out = []
    for p in psutil.process_iter(["status"]):
        try:
            if p.info["status"] != psutil.STATUS_ZOMBIE and os.getsid(p.pid) == sid:
                out.append(p)
        except (OSError, psutil.Error):
            continue
    return out


def _kill_session(sid: int) -> None:
    import psutil

    _signal_group(sid, signal.SIGKILL)
    for p in _session_procs(sid):  # outside the group, if anything made its own
        try:
            p.kill()
        except psutil.Error:  # gone meanwhile
            pass


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


def serve(target: str, config_path: str, port: int | None = None) -> int:
    components = load_graph(target)
    config = load_config(config_path)
    check_config(components, config, config_path, target)
    sup = Supervisor(components, config, port)
    # The handler only assigns: one that takes a lock (threading.Event.set does) deadlocks when a
    # second signal arrives while the first handler holds it (seen: SIGINT twice, serve hung).
    stop = {"requested": False}

    def requested() -> bool:
        return stop["requested"]

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.update(requested=True))
    log.info(f"[serve] graph: {' -> '.join(c.module for c in reversed(components))}")
    sup.start()
    code = 0
    try:
        if not sup.wait_ready(requested) and not requested():
            code = 1
            log.warning(f"[serve] not ready: {sup.dead() or 'timed out'}")
        while code == 0 and not requested():
            time.sleep(0.2)
            if dead := sup.tend():
                log.warning("[serve] component died: " + ", ".join(
                    f"{n} ({_exit(rc)})" for n, rc in dead) + "; stopping the graph")
                code = 1
    finally:
        log.info("[serve] stopping ...")
        sup.stop()
        log.info("[serve] stopped")
    return code
