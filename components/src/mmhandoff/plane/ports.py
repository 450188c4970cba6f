"""Ports assigned to a process before it binds them: NIXL side channels, Dynamo's status server.

A port found free by binding port 0 comes from the kernel's ephemeral range, where any process's
next bind(0) or outgoing connection can take it before the process it was meant for binds it.
That happened: vLLM's model worker took a prefill engine's NIXL side-channel port for its own
use, the engine's handshake listener could not bind, and vLLM waited for that listener for ever
(a graph that never became ready). So assigned ports come from below the ephemeral range, are
checked free, and are never handed out twice by one process. Dynamo reads DYN_SYSTEM_PORT as a
signed 16-bit integer, which also keeps ports at or under 32767.
"""

from __future__ import annotations

import random
import socket
import threading

LOW, HIGH = 20000, 32767
_taken: set[int] = set()
_lock = threading.Lock()


def _ephemeral_start() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def free_port(host: str = "127.0.0.1") -> int:
    """A port under the ephemeral range, free on `host` now and not given out before by this
    process."""
    high = min(HIGH, _ephemeral_start() - 1)
    with _lock:
        for _ in range(500):
            port = random.randint(LOW, high)
            if port in _taken:
                continue
            with socket.socket() as s:
                try:
                    s.bind((host, port))
                except OSError:
                    continue
            _taken.add(port)
            return port
    raise OSError(f"no free port in {LOW}-{high}")
