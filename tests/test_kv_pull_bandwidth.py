"""The KV-pull probe (benchmarks/kv_pull_bandwidth.py): its transport report and a real run."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.kv_pull_bandwidth import _transport

ROOT = Path(__file__).resolve().parents[1]

# As UCX 1.23 printed it on the H200 (UCX_PROTO_INFO=y), trimmed: a self table, then the peer's.
UCX_TABLES = """\
[1796334364.22] [vm:780  :0]   | d02a46e0 self cfg#1                                      |
[1796334364.22] [vm:780  :0]   | remote memory read by ucp_get* from host memory to host  |
[1796334364.22] [vm:780  :0]   | Range  | Description |              Config               |
[1796334364.22] [vm:780  :0]   | 0..inf | zero-copy   | cma/memory                        |
[1796334364.23] [vm:781  :0]   | ucp_context_0 intra-node cfg#2                           |
[1796334364.23] [vm:781  :0]   | remote memory read by ucp_get*(multi) into cuda/GPU0     |
[1796334364.23] [vm:781  :0]   +--------+--------------------+-----------------------------+
[1796334364.23] [vm:781  :0]   | Range  |    Description     |           Config            |
[1796334364.23] [vm:781  :0]   | 0..inf | software emulation | tcp/lo                      |
[1796334364.23] [vm:781  :0]   | remote memory write by ucp_put* from cuda/GPU0           |
[1796334364.23] [vm:781  :0]   | 0..inf | zero-copy          | cuda_ipc/cuda               |
"""


@pytest.mark.unit
def test_transport_is_the_peer_row_of_the_operation_asked_for():
    assert _transport(UCX_TABLES, "READ") == "0..inf software emulation tcp/lo"
    assert _transport(UCX_TABLES, "WRITE") == "0..inf zero-copy cuda_ipc/cuda"
    assert _transport("no tables here", "READ") == "(UCX reported no protocol line)"


@pytest.mark.engine  # two processes moving bytes through NIXL
def test_probe_moves_the_right_bytes_between_two_processes_on_cpu():
    out = subprocess.run(
        [sys.executable, "benchmarks/kv_pull_bandwidth.py", "--device", "cpu", "--blocks", "64",
         "--block-bytes", "65536", "--repeats", "2", "--arms", "default,write"],
        cwd=ROOT, capture_output=True, text=True, timeout=240,
        env={"UCX_NET_DEVICES": "lo", "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stdout + out.stderr
    rows = [line for line in out.stdout.splitlines() if line.startswith("{")]
    assert len(rows) == 2
    for row in rows:
        assert '"correct": true' in row
        assert "(UCX reported no protocol line)" not in row  # UCX said which transport served it
