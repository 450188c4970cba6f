"""Nagle off on this process's TCP servers (plane/nodelay.py): listeners and the connections
they accepted get TCP_NODELAY, later connections inherit it from the listener (the kernel
behaviour the fix relies on), outgoing connections are left alone."""

from __future__ import annotations

import socket

import pytest

from mmhandoff.plane import nodelay

pytestmark = pytest.mark.unit


def _nodelay(s: socket.socket) -> bool:
    return bool(s.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))


@pytest.fixture
def server():
    """A listener with Nagle on, one connection it accepted, and that connection's client."""
    listener = socket.create_server(("127.0.0.1", 0))
    client = socket.create_connection(listener.getsockname())
    accepted, _ = listener.accept()
    for s in (listener, client, accepted):
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 0)
    yield listener, client, accepted
    for s in (listener, client, accepted):
        s.close()


def test_listeners_and_their_connections_get_nodelay(server, monkeypatch):
    monkeypatch.delenv(nodelay.ENV, raising=False)
    listener, client, accepted = server
    assert nodelay.servers_without_delay() >= 2
    assert _nodelay(listener) and _nodelay(accepted)
    assert not _nodelay(client)  # an outgoing connection is its owner's business
    later = socket.create_connection(listener.getsockname())
    inherited, _ = listener.accept()
    try:
        assert _nodelay(inherited)  # accepted after: inherits the listener's setting (Linux)
    finally:
        later.close()
        inherited.close()
    assert nodelay.servers_without_delay() == 0  # nothing left to change


def test_switched_off_it_changes_nothing(server, monkeypatch):
    monkeypatch.setenv(nodelay.ENV, "0")
    listener, _, accepted = server
    assert nodelay.servers_without_delay() == 0
    assert not _nodelay(listener) and not _nodelay(accepted)


def test_closed_sockets_and_other_descriptors_are_skipped(server, monkeypatch, tmp_path):
    """Files, pipes, UDP and Unix sockets among the descriptors: passed over."""
    import os

    monkeypatch.delenv(nodelay.ENV, raising=False)
    udp, unix = socket.socket(socket.AF_INET, socket.SOCK_DGRAM), socket.socketpair()
    r, w = os.pipe()
    with open(tmp_path / "f", "w"), udp, unix[0], unix[1]:
        try:
            assert nodelay.servers_without_delay() >= 2
        finally:
            os.close(r)
            os.close(w)


def test_without_proc_it_changes_nothing(monkeypatch):
    """Not Linux (no /proc): nothing to look at, nothing raised."""
    import os

    monkeypatch.delenv(nodelay.ENV, raising=False)

    def missing(path):
        raise FileNotFoundError(path)

    monkeypatch.setattr(os, "listdir", missing)
    assert nodelay.servers_without_delay() == 0


def test_a_failing_scan_fails_no_request(monkeypatch):
    """The scan runs once per endpoint, at its first request served through Dynamo (not at an
    in-process call of the handler, as tests' planes make); whatever it raises, the request is
    answered."""
    import asyncio

    from mmhandoff.plane import runtime

    calls = []

    def broken():
        calls.append(1)
        raise RuntimeError("no scan today")

    monkeypatch.setattr(runtime, "servers_without_delay", broken)

    async def handler(request):
        yield {"answer": request["n"] + 1}

    async def answers(endpoint, ns):
        return [[item async for item in endpoint({"n": n})] for n in ns]

    in_process = runtime.endpoint_handler(handler, ())
    assert asyncio.run(answers(in_process, [0])) == [[{"answer": 1}]]
    assert calls == []  # not through Dynamo: no scan
    served = runtime.endpoint_handler(handler, (), served=True)
    assert asyncio.run(answers(served, [1, 2])) == [[{"answer": 2}], [{"answer": 3}]]
    assert calls == [1]  # once per endpoint
    again = runtime.endpoint_handler(handler, (), served=True)  # another endpoint: scans again
    assert asyncio.run(answers(again, [3])) == [[{"answer": 4}]] and calls == [1, 1]
