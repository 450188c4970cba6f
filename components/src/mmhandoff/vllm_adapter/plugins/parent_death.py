"""vLLM plugin (entry point `vllm.general_plugins`): an engine core process dies with the process
that started it.

vLLM's engine core is a child process of the component's (`EngineCore`), started as a daemon:
it ends when its parent exits normally, but a parent killed by SIGKILL (the OOM killer, a
`kill -9`, a crashed container runtime) leaves it running, waiting on a socket nobody will write
to, with its memory held (35 GB of a GPU stayed held once; issue 35). Here the engine core asks
Linux to send it SIGKILL when its parent dies (`prctl(PR_SET_PDEATHSIG)`), and checks that the
parent did not die before it asked. Its model workers (a GPU engine's multiprocessing executor)
already end with the engine core through vLLM's own death pipe; other processes are left alone.

vLLM loads its plugins once per process: a forked engine core inherits the API process's
"loaded" and does not run them again, so the API process also wraps the engine core's entry
(`EngineCoreProc.run_engine_core`, the child's target), and a spawned one asks as it loads them.
Linux sends the signal when the *thread* that started the child ends, not the process: the
component starts its engine from its main thread (process.engine_worker), whose end is the
process's. Set `MMHANDOFF_PARENT_DEATH=default` to leave vLLM's behaviour.
"""

from __future__ import annotations

import functools
import multiprocessing
import os
import sys

from mmhandoff.process.parent_death import die_with_parent

ENV = "MMHANDOFF_PARENT_DEATH"


def enabled() -> bool:
    value = os.environ.get(ENV, "on")
    if value not in ("on", "default"):
        raise ValueError(f"{ENV} must be 'on' or 'default', got {value!r}")
    return value == "on"


def is_engine_core() -> bool:
    """Whether this process is an engine core vLLM started as a child (`EngineCore`, or
    `EngineCore_DP<n>` with data parallelism)."""
    return (multiprocessing.parent_process() is not None
            and multiprocessing.current_process().name.startswith("EngineCore"))


def install() -> None:
    if not sys.platform.startswith("linux") or not enabled():
        return
    if is_engine_core():
        die_with_parent()
    _wrap_entry()


def _wrap_entry() -> None:
    """A forked engine core asks first thing (idempotent)."""
    from vllm.v1.engine.core import EngineCoreProc

    run = EngineCoreProc.run_engine_core
    if getattr(run, "mmhandoff_parent_death", False):
        return

    @functools.wraps(run)
    def run_engine_core(*args, **kwargs):
        die_with_parent()
        return run(*args, **kwargs)

    run_engine_core.mmhandoff_parent_death = True
    EngineCoreProc.run_engine_core = staticmethod(run_engine_core)
