"""An engine core dies with the process that started it (vllm_adapter/plugins/parent_death.py),
here on a stand-in process tree in a second; on a real engine in
test_components_standalone.py (prefill killed -9: its engine core and worker end)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from importlib.metadata import entry_points

import psutil
import pytest

pytestmark = pytest.mark.unit

# The "component": starts an "EngineCore" child as vLLM does (forked or spawned), which asks for
# its parent's death signal as the plugin has an engine core do; then prints the child's pid and
# waits to be killed.
PARENT = """
import multiprocessing, sys, time
from mmhandoff.vllm_adapter.plugins import parent_death

def core():
    assert parent_death.is_engine_core()
    parent_death.die_with_parent()
    time.sleep(60)

if __name__ == "__main__":
    child = multiprocessing.get_context(sys.argv[1]).Process(target=core, name="EngineCore")
    child.start()
    print(child.pid, flush=True)
    time.sleep(60)
"""


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_the_core_ends_when_its_parent_is_killed(method, tmp_path):
    script = tmp_path / "component.py"
    script.write_text(PARENT)
    parent = subprocess.Popen([sys.executable, str(script), method], stdout=subprocess.PIPE,
                              text=True)
    try:
        core = psutil.Process(int(parent.stdout.readline()))
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait(timeout=10)
        core.wait(timeout=10)  # psutil.TimeoutExpired here: the core outlived its parent
    finally:
        for p in psutil.Process().children(recursive=True):
            p.kill()


def test_other_processes_are_left_alone():
    from mmhandoff.vllm_adapter.plugins import parent_death

    assert not parent_death.is_engine_core()  # the test process: no parent process of its own


def test_vllm_finds_the_plugin():
    plugins = {e.name: e.value for e in entry_points(group="vllm.general_plugins")}
    assert plugins["mmhandoff_parent_death"] == \
        "mmhandoff.vllm_adapter.plugins.parent_death:install"
