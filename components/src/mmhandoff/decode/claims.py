"""Decode's side of single use across the graph: before it pulls a handoff's KV, it claims the
handoff at the prefill instance that holds the KV (prefill.claims), which grants each handoff
once. A refusal ends the request with the prefill's typed error (`replayed`, `expired`); a prefill
that cannot be asked (stopped, restarted, unreachable: its KV is gone with it) with
`claim_failed`, which the frontend retries through prefill.
"""

from __future__ import annotations

import asyncio
import time

import msgspec

from mmhandoff.plane.runtime import RemoteError, call_one
from mmhandoff.wire.handoff import ClaimFailed, Expired, Handoff, Replayed
from mmhandoff.wire.messages import ClaimRequest

# prefill answers a claim in about a millisecond; one that takes longer than this is lost
CLAIM_TIMEOUT_S = 5.0
# a claim endpoint seen for the first time: how long its instances may take to appear
DISCOVERY_S = 2.0
_REFUSALS = {"replayed": Replayed, "expired": Expired}


class ClaimClient:
    """Claims over the Dynamo runtime `rt`: one client per prefill claim endpoint (a graph has
    one or a few), made when a handoff first names it."""

    def __init__(self, rt, *, timeout_s: float = CLAIM_TIMEOUT_S) -> None:
        self.rt, self.timeout_s = rt, timeout_s
        self._clients: dict[str, asyncio.Future] = {}

    async def __call__(self, h: Handoff) -> None:
        """Claim `h` (which names where); raise a HandoffError if it is not granted."""
        c = await self._client(h.claim.endpoint)
        await _seen(c, h.claim.instance)
        request = msgspec.to_builtins(ClaimRequest(nonce=h.nonce, request_id=h.request_id))
        try:
            await call_one(c, request, h.claim.instance, lost="claim_failed",
                           stall_s=self.timeout_s)
        except RemoteError as e:
            refusal = _REFUSALS.get(e.code, ClaimFailed)
            raise refusal(e.message if refusal is not ClaimFailed else
                          f"the prefill holding handoff {h.request_id!r}'s KV did not grant it: "
                          f"[{e.code}] {e.message}") from None

    async def _client(self, endpoint: str):
        made = self._clients.get(endpoint)
        if made is None:  # made once, shared by the requests that wait for it meanwhile
            made = self._clients[endpoint] = asyncio.ensure_future(
                self.rt.endpoint(endpoint).client())
        try:
            return await asyncio.shield(made)
        except Exception as e:
            self._clients.pop(endpoint, None)
            raise ClaimFailed(f"no client for {endpoint}: {e!r}") from None


async def _seen(c, instance: int) -> None:
    """Wait (bounded) until discovery lists `instance`: a client made just now has not heard of
    every instance yet. One that stays unlisted is gone: its KV with it."""
    deadline = time.monotonic() + DISCOVERY_S
    while instance not in c.instance_ids():
        if time.monotonic() >= deadline:
            raise ClaimFailed(f"the prefill instance {instance:x} that holds the KV is gone")
        await asyncio.sleep(0.01)
