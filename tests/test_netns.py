"""The hosts harness itself (tests/netns.py): hosts reach each other over the bridge, and every
namespace goes away: on leaving, and from a run that crashed before it could clean up."""

from __future__ import annotations

import socket
import subprocess

import pytest

from tests.graph_runner import _listens
from tests.netns import Hosts, _namespaces

pytestmark = pytest.mark.unit


def test_hosts_reach_each_other_over_the_bridge_and_are_removed_after():
    with Hosts(["a", "b"]) as hosts:
        names = {hosts.ns("a"), hosts.ns("b"), hosts.ns("sw")}
        assert names <= set(_namespaces())
        # a listener on host b, at b's address; a sleeper that teardown must kill
        listener = subprocess.Popen(hosts.command("b", [
            "python3", "-c", "import socket,time; s=socket.socket(); "
            f"s.bind(('{hosts.ip('b')}', 7001)); s.listen(); print('up', flush=True); "
            "time.sleep(600)"]), stdout=subprocess.PIPE, text=True)
        assert listener.stdout.readline().strip() == "up"
        assert hosts.call("a", _listens, hosts.ip("b"), 7001)
        assert hosts.call("a", lambda: socket.if_nameindex())[-1][1] == "eth0"
    assert listener.wait(timeout=10) != 0  # killed with its namespace
    assert not names & set(_namespaces())


def test_namespaces_of_a_crashed_run_are_removed_at_the_next_start():
    dead = subprocess.Popen(["true"])
    dead.wait()
    stale = f"mmh-{dead.pid}-prefill"
    subprocess.run(["ip", "netns", "add", stale], check=True)
    try:
        with Hosts(["a"]):
            assert stale not in _namespaces()
    finally:
        subprocess.run(["ip", "netns", "delete", stale], capture_output=True)
