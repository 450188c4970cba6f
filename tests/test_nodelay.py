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
