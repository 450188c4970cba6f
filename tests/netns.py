"""Hosts on one machine: network namespaces joined by a bridge, for running a graph across
"hosts" (tests/test_multihost.py, scripts/multihost.py). Needs root (`ip netns`).

Each host is a namespace `mmh-<pid>-<name>` with loopback and one interface, `eth0`, at
10.77.0.<10+i>/24 on a bridge that lives in a namespace of its own (`mmh-<pid>-sw`): nothing is
added to the machine's own network. A process runs on a host through `ip netns exec`; this process
reaches a host's addresses through `Hosts.call`, which runs a function on a thread that entered
the host's namespace (setns applies to the calling thread only).

Teardown kills every process still in the namespaces and deletes them (the veths go with them),
on success and on failure; namespaces left by a run whose process is gone (a crash, a SIGKILL) are
removed when the next `Hosts` starts.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import os
import re
import signal
import subprocess
from typing import Any, Callable

PREFIX = "mmh-"
# UCX over TCP with socket buffers and segments sized for KV blocks instead of UCX's defaults:
# about twice the pull rate between two hosts here (benchmarks/across_hosts.py, docs/benchmarks.md)
UCX_TCP_TUNED = {"UCX_TCP_SNDBUF": "4m", "UCX_TCP_RCVBUF": "4m", "UCX_TCP_TX_SEG_SIZE": "64k",
                 "UCX_TCP_RX_SEG_SIZE": "64k"}
SUBNET = "10.77.0"
CLONE_NEWNET = 0x40000000
DEVICE = "eth0"


def _ip(*args: str, check: bool = True) -> str:
    out = subprocess.run(["ip", *args], capture_output=True, text=True)
    if check and out.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {out.stderr.strip()}")
    return out.stdout


def _namespaces() -> list[str]:
    return [line.split()[0] for line in _ip("netns", "list").splitlines() if line.strip()]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _delete(ns: str) -> None:
    """Kill what runs in `ns`, then delete it."""
    for pid in _ip("netns", "pids", ns, check=False).split():
        try:
            if int(pid) != os.getpid():
                os.kill(int(pid), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            pass
    _ip("netns", "delete", ns, check=False)


def remove_stale() -> list[str]:
    """Delete the namespaces of earlier runs whose process is gone; returns their names."""
    stale = [ns for ns in _namespaces()
             if (m := re.match(rf"{PREFIX}(\d+)-", ns)) and not _alive(int(m[1]))]
    for ns in stale:
        _delete(ns)
    return stale


def enter(ns: str) -> None:
    """Move the calling thread (and the threads it starts later) into namespace `ns`."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(f"/run/netns/{ns}", os.O_RDONLY)
    try:
        if libc.setns(fd, CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns({ns}): {os.strerror(err)}")
    finally:
        os.close(fd)


class Hosts:
    """`Hosts(["infra", "prefill", "decode", "front"])`: one namespace per name, on one bridge."""

    def __init__(self, names: list[str]) -> None:
        self.names = list(names)
        self.tag = f"{PREFIX}{os.getpid()}"
        self._threads: dict[str, concurrent.futures.ThreadPoolExecutor] = {}
        remove_stale()
        try:
            self._build()
        except BaseException:
            self.close()
            raise

    def ns(self, name: str) -> str:
        return f"{self.tag}-{name}"

    def ip(self, name: str) -> str:
        return f"{SUBNET}.{10 + self.names.index(name)}"

    def _build(self) -> None:
        sw = self.ns("sw")
        _ip("netns", "add", sw)
        _ip("-n", sw, "link", "add", "br0", "type", "bridge")
        _ip("-n", sw, "link", "set", "br0", "up")
        for i, name in enumerate(self.names):
            ns = self.ns(name)
            _ip("netns", "add", ns)
            _ip("-n", ns, "link", "set", "lo", "up")
            _ip("-n", sw, "link", "add", f"h{i}", "type", "veth", "peer", "name", DEVICE,
                "netns", ns)
            _ip("-n", sw, "link", "set", f"h{i}", "master", "br0", "up")
            _ip("-n", ns, "addr", "add", f"{self.ip(name)}/24", "dev", DEVICE)
            _ip("-n", ns, "link", "set", DEVICE, "up")

    def command(self, name: str, argv: list[str]) -> list[str]:
        """`argv` run on host `name`."""
        return ["ip", "netns", "exec", self.ns(name), *argv]

    def env(self, name: str) -> dict[str, str]:
        """What a component on host `name` needs to advertise and move KV from there: its address
        for Dynamo and the NIXL side channel (as POD_IP would be on Kubernetes), and UCX on that
        host's interface over TCP only (no shared memory or CMA between "hosts": on one machine
        UCX would otherwise use them across namespaces), with UCX_TCP_TUNED."""
        ip = self.ip(name)
        return {"POD_IP": ip, "DYN_TCP_RPC_HOST": ip, "DYN_TCP_RESPONSE_STREAM_HOST": ip,
                "DYN_EVENT_PLANE_HOST": ip, "DYN_SYSTEM_HOST": ip, "UCX_NET_DEVICES": DEVICE,
                "UCX_TLS": "tcp", **UCX_TCP_TUNED}

    def call(self, name: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """`fn(*args, **kwargs)` on a thread inside host `name`'s namespace (its sockets are that
        host's)."""
        if name not in self._threads:
            self._threads[name] = concurrent.futures.ThreadPoolExecutor(
                1, thread_name_prefix=f"netns-{name}", initializer=enter,
                initargs=(self.ns(name),))
        return self._threads[name].submit(fn, *args, **kwargs).result()

    def close(self) -> None:
        for pool in self._threads.values():
            pool.shutdown(wait=False, cancel_futures=True)
        self._threads.clear()
        for ns in [self.ns(n) for n in self.names] + [self.ns("sw")]:
            if ns in _namespaces():
                _delete(ns)

    def __enter__(self) -> "Hosts":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
