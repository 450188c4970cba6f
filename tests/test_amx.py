"""The amx plugin: after it runs, the process may use the AMX tile registers (Linux's permitted
xfeatures include XTILEDATA), which vLLM's CPU attention kernel needs; without it, a decode
engine's worker died with SIGILL at its first handoff on an AMX host. Checked in fresh processes:
the permission, once granted, is the process's for good."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = pytest.mark.unit

# arch_prctl(ARCH_GET_XCOMP_PERM) through syscall(2): the permitted xfeature mask of the process.
PROBE = r"""
import ctypes, sys
libc = ctypes.CDLL(None, use_errno=True)

def permitted():
    mask = ctypes.c_uint64(0)
    if libc.syscall(158, 0x1022, ctypes.byref(mask)) != 0:  # SYS_arch_prctl, ARCH_GET_XCOMP_PERM
        sys.exit("arch_prctl failed")
    return bool(mask.value & (1 << 18))  # XTILEDATA

before = permitted()
# vLLM's platform probe (3 s of imports) stood in for by its answer on this host: a CPU platform
import types
platforms = types.ModuleType("vllm.platforms")
platforms.current_platform = types.SimpleNamespace(is_cpu=lambda: True)
sys.modules["vllm.platforms"] = platforms
import torch
amx = torch.cpu._is_amx_tile_supported()
with_torch = permitted()
from mmhandoff.vllm_adapter.plugins import amx as plugin
plugin.install()
print(amx, before, with_torch, permitted())
"""


@pytest.mark.skipif(sys.platform != "linux" or __import__("platform").machine() != "x86_64",
                    reason="AMX and arch_prctl are x86-64 Linux")
def test_the_plugin_grants_amx_where_the_cpu_has_it():
    """In one fresh process: no permission at start nor after importing torch; after the plugin,
    exactly where the CPU has AMX."""
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    amx, before, with_torch, after_plugin = (w == "True" for w in out.stdout.split())
    assert not before and not with_torch
    assert after_plugin == amx  # granted exactly where the CPU has AMX; elsewhere a no-op


def test_the_plugin_is_registered_with_vllm():
    from importlib.metadata import entry_points

    plugins = {e.name: e.value for e in entry_points(group="vllm.general_plugins")}
    assert plugins.get("mmhandoff_amx") == "mmhandoff.vllm_adapter.plugins.amx:install"
