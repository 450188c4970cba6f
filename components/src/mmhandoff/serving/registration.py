"""A worker that is no longer in discovery gets no requests, though it runs and reports healthy.

That happens when etcd is away longer than a worker's lease (10 s) but comes back before the
Dynamo runtime's reconnect deadline (~30 s; after it the runtime stops serving and the worker
exits): the runtime reconnects, but its instance's key went with the expired lease and Dynamo does
not write it again (ai-dynamo/dynamo#3493). Measured on a disagg graph: every request then got
503 `prefill_failed` while every process stayed up. So each worker watches its own instance in
discovery and, once it has been missing for `LOST_AFTER_S`, ends with exit 1: `serve` restarts
it (a component with several replicas) or stops the graph, and Kubernetes restarts a pod.
"""

from __future__ import annotations

import asyncio
import time

LOST_AFTER_S = 10.0


async def lost_registration(rt, path: str, *, after_s: float = LOST_AFTER_S,
                            every_s: float = 1.0) -> None:
    """Returns once this process's instance of `path` has been missing from discovery for
    `after_s`, having been there before."""
    endpoint = rt.endpoint(path)
    instances = await endpoint.client()
    seen, missing_since = False, None
    while True:
        await asyncio.sleep(every_s)
        if endpoint.connection_id() in instances.instance_ids():  # the id may change: ask again
            seen, missing_since = True, None
        elif seen:
            missing_since = missing_since or time.monotonic()
            if time.monotonic() - missing_since >= after_s:
                return
