"""vLLM plugin (entry point `vllm.general_plugins`): on CPU hosts, an engine's processes wait for
each other without holding a core.

A vLLM engine on CPU always runs the model in a worker process (vLLM forces the multiprocessing
executor there) that talks to its engine-core process through a shared-memory ring
(`shm_broadcast`). A reader of that ring spins (`sched_yield` in a loop) for 1 s after every
message before it parks on a ZMQ notification. Under load a message comes every step, so the
worker and the engine core spin for as long as the engine has work, and for 1 s after. On a
machine with few cores those spins take the cores the serving processes need (frontend, workers,
the Dynamo runtime): on 2 cores the graph's TTFT doubled and its throughput at concurrency 8 was
0.29x of the same handoff in one process (docs/benchmarks.md).

Here a reader spins for `MMHANDOFF_SHM_SPIN_S` (default 2 ms) after a message, then waits on the
notification with a wake-up every millisecond. The wake-up is needed: ZMQ notifications are lost
now and then (vLLM itself re-checks the ring every 5 s for that reason, which with a short spin
stalled requests for 5 s). A reader's cancel (at shutdown) no longer blocks; see
`_cancel_without_blocking`. Set `MMHANDOFF_SHM_SPIN_S=default` to keep vLLM's behaviour. GPU
hosts are left alone: with one GPU there is no worker process and no ring, and with several
the spinning cores are a fair price on a large host.
"""

from __future__ import annotations

import threading
import time

from mmhandoff.vllm_adapter.plugins.plugin_setting import number_or_default

ENV = "MMHANDOFF_SHM_SPIN_S"
RECHECK_MS = 1  # the longest a lost notification can delay a reader


def spin_seconds() -> float | None:
    """The configured spin window in seconds; None: leave vLLM's own."""
    return number_or_default(ENV, "0.002", "seconds", 0, 10)


def install() -> None:
    """Patch `SpinCondition.wait` and `.cancel` in this process (idempotent; a no-op off
    CPU)."""
    from vllm.platforms import current_platform

    seconds = spin_seconds()
    if seconds is None or not current_platform.is_cpu():
        return
    import zmq
    from vllm.distributed.device_communicators import shm_broadcast

    condition = shm_broadcast.SpinCondition
    if getattr(condition.wait, "mmhandoff_spin_s", None) is not None:
        return
    sched_yield = shm_broadcast.sched_yield

    def wait(self, timeout_ms: int | None = None) -> None:
        # Same contract as vLLM's: return when the ring may have a message, a cancel came, or
        # the timeout passed; the caller re-checks the ring (and its cancel flag) every time.
        if time.monotonic() <= self.last_read + seconds:
            sched_yield()
            return
        cap = RECHECK_MS if timeout_ms is None else min(timeout_ms, RECHECK_MS)
        if self.local_notify_socket in dict(self.poller.poll(timeout=cap)):
            self.local_notify_socket.recv(flags=zmq.NOBLOCK, copy=False)

    wait.mmhandoff_spin_s = seconds
    condition.wait = wait
    condition.cancel = _cancel_without_blocking(zmq)


def _cancel_without_blocking(zmq):
    """vLLM's `SpinCondition.cancel` (wake a reader so that it sees its queue shut down) sends
    on a ZMQ socket, from the model worker's death-pipe thread and again from its teardown in
    the main thread. ZMQ sockets are not thread-safe, and that send blocked a worker's
    teardown until its engine core killed it, 9 s later, leaking its shared memory and a
    semaphore (the stacks faulthandler dumped 3 s into the teardown: in `cancel`, in zmq's
    `send`; a graph stop in about one CI run in three).
    With the wait above a reader re-checks its queue's shutdown flag every RECHECK_MS anyway:
    the wake-up is only a hint, sent by one thread at a time and never waited for."""
    lock = threading.Lock()

    def cancel(self) -> None:
        if self.is_reader:
            with lock:
                try:
                    self.write_cancel_socket.send(b"\x00", flags=zmq.NOBLOCK)
                except zmq.ZMQError:  # the hint is queued already, or its reader is gone
                    pass

    return cancel
