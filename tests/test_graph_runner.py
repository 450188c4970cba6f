"""The graph harness's own checks: what a stopped graph left in /dev/shm is judged by whether a
live process still holds it (another program's) or not (the graph's leak)."""

from __future__ import annotations

import os
import subprocess
import sys
from multiprocessing import shared_memory

import pytest

from tests.graph_runner import held_by_live_processes

pytestmark = pytest.mark.unit

HOLDER = r"""
import sys, time
from multiprocessing import shared_memory
block = shared_memory.SharedMemory(create=True, size=4096)
print(block.name, flush=True)
sys.stdin.read()  # held until told
block.close(); block.unlink()
"""


def test_shared_memory_another_process_holds_is_told_from_a_leak():
    holder = subprocess.Popen([sys.executable, "-c", HOLDER], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    leaked = shared_memory.SharedMemory(create=True, size=4096)
    try:
        held = holder.stdout.readline().strip()
        leaked.close()  # nothing maps it now: what an exited graph process would leave
        names = {held, leaked.name}
        assert all(os.path.exists(f"/dev/shm/{n}") for n in names)
        assert held_by_live_processes(names) == {held}
    finally:
        holder.communicate("", timeout=30)
        leaked.unlink()
    assert holder.returncode == 0
    assert held_by_live_processes({held}) == set()  # its holder ended (and removed it)
