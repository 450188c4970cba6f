"""Assigned ports never come from the ephemeral range (where vLLM's own port picks can take one
before the process it was meant for binds it) and are never handed out twice."""

from __future__ import annotations

import pytest

from mmhandoff.plane import ports

pytestmark = pytest.mark.unit


def test_ports_are_below_the_ephemeral_range_free_and_distinct():
    start = ports._ephemeral_start()
    got = [ports.free_port() for _ in range(200)]
    assert len(set(got)) == len(got)
    assert all(ports.LOW <= p < min(start, ports.HIGH + 1) for p in got)


def test_a_port_in_use_is_not_handed_out(monkeypatch):
    import socket

    in_use, free = ports.free_port(), ports.free_port()
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", in_use))
        picks = iter([in_use, in_use, free])
        monkeypatch.setattr(ports.random, "randint", lambda a, b: next(picks))
        monkeypatch.setattr(ports, "_taken", set())
        assert ports.free_port() == free
