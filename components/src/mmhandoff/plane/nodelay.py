"""Nagle's algorithm off on the connections this process's TCP servers accept.

ai-dynamo-runtime 1.6's TCP request-plane server leaves TCP_NODELAY off on the connections it
accepts (its clients, and both ends of its response streams, set it). The server acknowledges
each request with a 4-byte write on that connection, and the caller reads no item of a
response stream before the request's acknowledgement. With several requests in flight on one
connection (a frontend's requests to a worker share one), Nagle holds every acknowledgement
after the first until the caller ACKs the first, and the caller delays that ACK by Linux's
40 ms delayed-ACK floor: measured on this hop alone (benchmarks/plane_hop.py), requests at 1 in
flight took 1.1 ms, at 4 or 8 in flight 43 ms each; with TCP_NODELAY 3 and 5 ms.

Linux copies a listening socket's TCP_NODELAY to each connection it accepts afterwards, so the
listeners get it, and connections they accepted before get it too. Every TCP server in these
processes (Dynamo's request plane and status server, vLLM's NIXL side channel through ZMQ,
which sets it itself) answers requests, where Nagle only delays small writes.
"""

from __future__ import annotations

import os
import socket

ENV = "MMHANDOFF_REQUEST_PLANE_NODELAY"  # "0": leave Dynamo's sockets as they are (benchmarks)


def _tcp_sockets() -> list[socket.socket]:
    """Duplicates of this process's TCP sockets (closing one leaves the original open)."""
    out = []
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:  # no /proc (not Linux): nothing to look at
        return out
    for name in names:
        try:
            if not os.readlink(f"/proc/self/fd/{name}").startswith("socket:"):
                continue
            sock = socket.socket(fileno=os.dup(int(name)))
        except OSError:  # closed meanwhile, or not a socket Python can wrap
            continue
        if sock.family in (socket.AF_INET, socket.AF_INET6) and sock.type == socket.SOCK_STREAM:
            out.append(sock)
        else:
            sock.close()
    return out


def _set(sock: socket.socket) -> bool:
    """TCP_NODELAY on `sock`; whether it was off."""
    try:
        if sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY):
            return False
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return True
    except OSError:  # closed by its owner meanwhile
        return False


def _listening(sock: socket.socket) -> tuple[bool, int] | None:
    """Whether `sock` listens, and its port; None if it closed meanwhile."""
    try:
        return bool(sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN)), \
            sock.getsockname()[1]
    except OSError:
        return None


def servers_without_delay() -> int:
    """TCP_NODELAY on this process's listening TCP sockets and on the connections they have
    accepted; how many sockets had it off. Two passes over the process's descriptors: the
    listeners first (a connection accepted from then on inherits it), then the connections, so
    that one accepted meanwhile is not missed."""
    if os.environ.get(ENV, "1") == "0":
        return 0
    changed, ports = 0, set()
    for sock in _tcp_sockets():
        with sock:
            if (state := _listening(sock)) is not None and state[0]:
                ports.add(state[1])
                changed += _set(sock)
    for sock in _tcp_sockets():
        with sock:
            if (state := _listening(sock)) is not None and not state[0] and state[1] in ports:
                changed += _set(sock)
    return changed
