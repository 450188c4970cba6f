"""A worker that is no longer in discovery gets no requests, though it runs and reports healthy.

That happens when etcd is away longer than a worker's lease (10 s) but comes back before the
Dynamo runtime's reconnect deadline (~30 s; after it the runtime stops serving and the worker
exits): the runtime reconnects, but its instance's key went with the expired lease and Dynamo does
not write it again (ai-dynamo/dynamo#3493). Measured on a disagg graph: every request then got
503 `prefill_failed` while every process stayed up. So each worker watches its own instance in
discovery and, once it has been missing for `LOST_AFTER_S`, ends with exit 1: `serve` restarts
it (a component with several replicas) or stops the graph, and Kubernetes restarts a pod.

A worker whose instance never shows up in discovery is in the same state from the start (it
reports ready, nobody calls it): after `FIRST_SEEN_S` it ends the same way, saying so.
"""

from __future__ import annotations

import asyncio
import time

LOST_AFTER_S = 10.0
FIRST_SEEN_S = 60.0


async def lost_registration(endpoint, *, after_s: float = LOST_AFTER_S,
                            every_s: float = 1.0, first_seen_s: float = FIRST_SEEN_S) -> str:
    """Returns why this process's instance of `endpoint` is not in discovery, once that is so:
    "lost", missing for `after_s` after it had been there, or "never", not there `first_seen_s`
    after the watch began.

    `endpoint` is the runtime's Endpoint, taken before serving it: `rt.endpoint(path)` called
    while the runtime registers that endpoint blocked the calling thread for good (seen with
    etcd and NATS: py-spy showed a prefill's event loop stopped on it, the worker reported ready
    and was never in discovery)."""
    instances = await endpoint.client()
    seen, missing_since, began = False, None, time.monotonic()
    while True:
        await asyncio.sleep(every_s)
        if endpoint.connection_id() in instances.instance_ids():  # the id may change: ask again
            seen, missing_since = True, None
        elif seen:
            missing_since = missing_since or time.monotonic()
            if time.monotonic() - missing_since >= after_s:
                return "lost"
        elif time.monotonic() - began >= first_seen_s:
            return "never"


def lost_message(why: str) -> str:
    if why == "never":
        return (f"not in discovery {FIRST_SEEN_S:.0f} s after it began serving (its "
                f"registration never reached etcd or the discovery folder): exiting")
    return (f"not in discovery for {LOST_AFTER_S:.0f} s (its lease ended while etcd was "
            f"away?): exiting")