"""vLLM plugin (entry point `vllm.general_plugins`): an engine whose only work is KV blocks held
for a consumer polls its connector every few milliseconds instead of back to back.

After prefill, the producer keeps a finished request's blocks until decode has pulled them (or
the lease ends). vLLM 0.31 counts such a request as work (`Scheduler.has_requests`), so its
engine core runs empty steps, each a message to the model worker so the connector can report
finished sends, with only a 1 ms sleep between them. The worker then never parks (its ring spin
window is longer than the gap) and the engine held 1.42 cores of a 2-core host from prefill's
answer to decode's pull: the very time the frontend, the Dynamo hops and decode need the CPU
(and for a whole lease after a handoff nobody pulls).

Here, when a step ran no model and the scheduler has nothing left to compute (only blocks held
for a consumer), the engine core waits on its input queue for up to `MMHANDOFF_HELD_KV_POLL_MS`
(default 10) instead: a new request or abort ends the wait at once; the blocks of a finished
pull are freed at most that much later. Steps with requests to compute, including requests
waiting for their own KV pull, keep vLLM's pacing. Set the variable to `default` to keep vLLM's.

And at shutdown, blocks held for a consumer are not work to wait for: vLLM's engine core keeps
stepping until it has no work left, so a prefill stopped with a handoff nobody pulled yet kept
running until the lease ended (30 s), past the shutdown's grace (VllmEngine's 15 s), and was
force-killed, leaking its shared memory (the graph tests' "unclean stop"). Here it ends at once;
a consumer that comes later finds the side channel gone and fails closed.
"""

from __future__ import annotations

import queue

from mmhandoff.vllm_adapter.plugins.plugin_setting import number_or_default

ENV = "MMHANDOFF_HELD_KV_POLL_MS"


def poll_seconds() -> float | None:
    """The configured poll interval in seconds; None: leave vLLM's own pacing."""
    ms = number_or_default(ENV, "10", "milliseconds", 0, 1000, low_inclusive=False)
    return None if ms is None else ms / 1000


def only_held_blocks(core) -> bool:
    """True when the engine's only work is finished requests whose blocks a consumer holds."""
    scheduler = core.scheduler
    return (not scheduler.has_unfinished_requests() and scheduler.has_requests()
            and not core.engines_running and not core.batch_queue)


def wait_for_input(core, seconds: float) -> None:
    """Up to `seconds` for the next client request, which is handled at once (as vLLM's own input
    loop does; the rest of the queue vLLM drains itself before the next step)."""
    try:
        request = core.input_queue.get(timeout=seconds)
    except queue.Empty:
        return
    core._handle_client_request(*request)


def install() -> None:
    """Patch `EngineCoreProc._process_engine_step` and `has_work` in this process
    (idempotent)."""
    from vllm.v1.engine.core import EngineCoreProc

    _stop_without_waiting_for_consumers(EngineCoreProc)
    seconds = poll_seconds()
    if seconds is None:
        return

    step = EngineCoreProc._process_engine_step
    if getattr(step, "mmhandoff_poll_s", None) is not None:
        return

    def process_engine_step(self) -> bool:
        executed = step(self)
        if not executed and only_held_blocks(self):
            wait_for_input(self, seconds)
        return executed

    process_engine_step.mmhandoff_poll_s = seconds
    EngineCoreProc._process_engine_step = process_engine_step


def _stop_without_waiting_for_consumers(cls) -> None:
    has_work = cls.has_work
    if getattr(has_work, "mmhandoff_stop", False):
        return

    def has_work_unless_stopping(self) -> bool:
        if not self.is_running() and only_held_blocks(self):
            return False
        return has_work(self)

    has_work_unless_stopping.mmhandoff_stop = True
    cls.has_work = has_work_unless_stopping
