"""The life every component process shares (frontend, router, engine workers): once ready, it
serves until SIGINT/SIGTERM, until its own entry in discovery is gone (plane.registration: out of
discovery nobody calls it, so it exits 1 for serve or Kubernetes to restart it), or until one of
its own ends comes (a worker: its engine died, its endpoint stopped serving). Each then stops in
its own way (drain, shut the engine down); `until_stopped` says why it is stopping as the exit
code."""

from __future__ import annotations

import asyncio
import logging
import signal
from typing import Callable

from mmhandoff.plane.registration import lost_message, lost_registration

log = logging.getLogger(__name__)

# A component's own end: a task, and what its end means, (exit code, a line to log or None).
Ends = dict[asyncio.Future, Callable[[asyncio.Future], tuple[int, str | None]]]


async def until_stopped(name: str, registered, ends: Ends | None = None) -> int:
    """Wait for a stop signal (exit code 0), the loss of `registered`'s instance in discovery
    (1), or the first of `ends` (checked before the registration, in their order). `registered`
    is the runtime's Endpoint, taken before it was served (plane.registration says why)."""
    ends = ends or {}
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    stopped = asyncio.ensure_future(stop.wait())
    lost = asyncio.ensure_future(lost_registration(registered))
    await asyncio.wait([stopped, lost, *ends], return_when=asyncio.FIRST_COMPLETED)
    code, line = 0, None
    for task, meaning in ends.items():
        if task.done():
            code, line = meaning(task)
            break
    else:
        if lost.done():
            code, line = 1, lost_message(lost.result())
    if line is not None:
        log.info(f"[{name}] {line}")
    for task in (stopped, lost):
        task.cancel()
    return code
