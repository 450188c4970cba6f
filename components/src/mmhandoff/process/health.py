"""A worker's health, as Kubernetes and `mmhandoff serve` read it.

Dynamo's system status server (on when `DYN_SYSTEM_PORT` is set; the Dynamo operator sets it)
answers `/live` and `/health`: 200 while the process says it is ready, 503 otherwise. A worker
starts "not ready", turns ready once its engine is up and its endpoint is served, and turns not
ready again when it starts to shut down or when its engine dies. A dead engine also ends the
process with exit code 3 (`ENGINE_DEAD`): its requests can only fail from then on, so the
worker leaves discovery and lets its supervisor (serve, or Kubernetes) act, instead of staying
registered and failing every request sent to it.
"""

from __future__ import annotations

import asyncio
import logging
import os

log = logging.getLogger(__name__)

ENGINE_DEAD = 3
# How often the engine is looked at: vLLM's own monitor thread notices a dead engine core at
# once and sets a flag; reading it is free.
INTERVAL_S = 0.5


# Dynamo 1.6.1 reads DYN_SYSTEM_PORT as a signed 16-bit integer: above this, the runtime
# refuses to start ("expected i16"), so ports come from below the kernel's ephemeral range.
MAX_SYSTEM_PORT = 32767


def start_not_ready() -> None:
    """Call before the Dynamo runtime is created: it reads the starting status once."""
    port = os.environ.get("DYN_SYSTEM_PORT", "")
    if port and not (port.isdigit() and 0 < int(port) <= MAX_SYSTEM_PORT):
        raise SystemExit(f"DYN_SYSTEM_PORT={port}: the Dynamo runtime takes ports 1-"
                         f"{MAX_SYSTEM_PORT} only")
    os.environ.setdefault("DYN_SYSTEM_STARTING_HEALTH_STATUS", "notready")


def free_system_port() -> int:
    """A loopback port the system status server can take (see MAX_SYSTEM_PORT)."""
    from mmhandoff.plane.ports import free_port

    return free_port()


async def watch_engine(rt, engine, name: str, interval_s: float = INTERVAL_S) -> str:
    """Returns the cause once `engine` is dead, after marking this process not ready."""
    while (cause := engine.dead_cause()) is None:
        await asyncio.sleep(interval_s)
    rt.set_health_status(False)
    log.warning(f"[{name}] engine died ({cause}): not ready; exiting with {ENGINE_DEAD}")
    return cause
