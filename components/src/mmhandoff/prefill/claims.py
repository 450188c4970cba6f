"""Single use across the graph: the prefill instance that holds a handoff's KV grants it once.

Each replica's ReplayGuard admits a handoff once, but a copy replayed to another decode replica
passed it, and by then prefill may have freed those blocks and reused them: that pull read
another request's KV and cached it under this prompt's hashes. So prefill, which alone knows
what it issued and still holds, records the nonce of every handoff that names KV (ClaimBook),
and the handoff names where to claim it (`Handoff.claim`, signed). Decode claims before it
pulls; the first claim takes the nonce, any later one is refused (`replayed`), and so is one
after the handoff's expiry (`expired`: the blocks may be gone). A restarted prefill knows no
nonce: its predecessor's handoffs are refused, as their KV went with it.

A handoff nobody claims (its delivery lost: a crashed frontend, a dead router) would hold its
blocks until prefill's lease ends. Decode claims at admission, milliseconds after delivery, so
one still unclaimed `release_after_s` after it was issued is revoked (`revoke_unclaimed`): a
later claim is refused as `expired` (the frontend retries through prefill) and prefill frees
the blocks (PrefillWorker). The revocation comes first, so no decode can be pulling them.
"""

from __future__ import annotations

import logging
import time
from typing import AsyncIterator, Callable

import msgspec

from mmhandoff.wire.handoff import Claim, Expired, Handoff, Replayed
from mmhandoff.wire.messages import Claimed, ClaimRequest

log = logging.getLogger(__name__)


class ClaimBook:
    """The nonces of the handoffs this prefill issued with a claim and nobody has claimed yet,
    until they expire. Memory is bounded by the rate of handoffs times their TTL."""

    def __init__(self, at: Callable[[], Claim]) -> None:
        """`at`: where this prefill is claimed now (its instance id may change when the runtime
        reconnects, so it is asked for each handoff)."""
        self.at = at
        self._open: dict[str, float] = {}  # nonce -> expires_at, in issue order
        self._issued: dict[str, tuple[float, dict]] = {}  # nonce -> (issued at, KV params)
        self._revoked: dict[str, float] = {}  # nonce -> expires_at: refused as expired
        self._next_prune = 0.0

    def issue(self, h: Handoff, now: float | None = None) -> None:
        """Record a signed handoff whose `claim` names this book."""
        self._open[h.nonce] = h.expires_at
        self._issued[h.nonce] = (time.time() if now is None else now, h.kv_transfer_params)

    def unsettled(self) -> int:
        """How many issued handoffs are neither claimed nor revoked yet."""
        return len(self._issued)

    def revoke_unclaimed(self, after_s: float, now: float | None = None) -> list[dict]:
        """Revoke the handoffs issued more than `after_s` ago and still unclaimed; their
        `kv_transfer_params`, for the engine to free their blocks."""
        now = time.time() if now is None else now
        released = []
        for nonce, (issued_at, params) in list(self._issued.items()):  # in issue order
            if now - issued_at < after_s:
                break
            del self._issued[nonce]
            expires_at = self._open.pop(nonce, None)
            if expires_at is not None:  # unclaimed
                self._revoked[nonce] = expires_at
                released.append(params)
        self._prune(now)
        return released

    def claim(self, nonce: str, request_id: str, now: float | None = None) -> None:
        """Grant `nonce` once; raise Replayed (claimed before, or never issued by this run of
        prefill) or Expired."""
        now = time.time() if now is None else now
        expires_at = self._open.pop(nonce, None)
        self._issued.pop(nonce, None)
        revoked = self._revoked.pop(nonce, None) is not None
        self._prune(now)
        if revoked:
            raise Expired(f"handoff {request_id!r} was not claimed in time: its prefill "
                          "released the KV")
        if expires_at is None:
            raise Replayed(f"handoff {request_id!r} is not open at its prefill: claimed before "
                           "(a handoff's KV is read once), expired, or issued before prefill "
                           "restarted")
        if now > expires_at:
            raise Expired(f"handoff {request_id!r} expired before decode claimed it")

    def _prune(self, now: float) -> None:
        """Forget what expired, at most once a second."""
        if now < self._next_prune:
            return
        self._open = {n: t for n, t in self._open.items() if t >= now}
        self._revoked = {n: t for n, t in self._revoked.items() if t >= now}
        self._issued = {n: v for n, v in self._issued.items() if n in self._open}
        self._next_prune = now + 1.0

    def __len__(self) -> int:
        return len(self._open)

    async def handle(self, request: dict) -> AsyncIterator[dict]:
        """Dynamo endpoint handler (`<prefill>.claim`): a ClaimRequest in, Claimed out."""
        claim = msgspec.convert(request, ClaimRequest)
        self.claim(claim.nonce, claim.request_id)
        yield msgspec.to_builtins(Claimed(request_id=claim.request_id))


ERRORS = (Replayed, Expired, msgspec.ValidationError)
