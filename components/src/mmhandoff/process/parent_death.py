"""A child process that dies with its parent: a parent killed by SIGKILL (the OOM killer, a
`kill -9`) runs no clean-up, and a child left waiting on a pipe nobody writes to holds its
memory (a vLLM engine core once held 35 GB of a GPU; issue 35). Used by vLLM's engine core
(vllm_adapter.plugins.parent_death) and by the media processes (media.pool)."""

from __future__ import annotations

import ctypes
import logging
import multiprocessing
import os
import signal
import sys

PR_SET_PDEATHSIG = 1  # linux/prctl.h

log = logging.getLogger(__name__)


def die_with_parent() -> None:
    """SIGKILL this process when its parent dies; exit now if it has died already. Linux sends
    the signal when the parent's *thread* that started this process ends, not the parent
    process: start such children from a thread that lives as long as the process."""
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        log.warning(f"[mmhandoff] prctl(PR_SET_PDEATHSIG) failed (errno {ctypes.get_errno()}): "
                    f"process {os.getpid()} may outlive its parent")
        return
    # the parent may have died between this process's start and the prctl: then it was
    # re-parented already and no signal will come
    if os.getppid() != multiprocessing.parent_process().pid:
        os._exit(1)
