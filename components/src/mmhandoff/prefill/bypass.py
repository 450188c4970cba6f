"""Prefill bypass: a prompt whose KV a decode replica already holds through its last image (a
follow-up turn, the same question again) goes to that replica without prefill's engine.

Prefill renders the prompt as always (the only place with the model's renderer: token ids,
one hash and span per image), asks the router which decode replica holds most of its leading
blocks (`router.held`, by the engines' own hashes), and when that replica holds every block
through the end of the last image span and leaves at most `max_tokens` prompt tokens to compute,
it answers with a handoff that names no KV to pull. Decode computes the rest of the prompt and
the whole answer; its fail-closed scheduler refuses the handoff if the blocks were evicted in
between, and the frontend then sends the request through prefill again (`allow_bypass` False):
never a wrong answer. No media reaches decode either way.
"""

from __future__ import annotations

import msgspec

from mmhandoff.plane.runtime import call_one
from mmhandoff.wire.handoff import Handoff
from mmhandoff.wire.messages import HandoffMessage, KvHeld

LOOKUP_S = 2.0  # a router slower than this: prefill as usual


class RouterLookup:
    """Asks the router's `held` endpoint (a Dynamo client) about a prompt."""

    def __init__(self, client) -> None:
        self.client = client

    async def held(self, handoff: bytes) -> KvHeld:
        """`handoff`: its bytes, signed (the router trusts signed block hashes only)."""
        raw = await call_one(self.client, msgspec.to_builtins(HandoffMessage(handoff)),
                             lost="router_lost", stall_s=LOOKUP_S)
        return msgspec.convert(raw, KvHeld)


def decode_can_answer(handoff: Handoff, held: KvHeld, block_size: int, max_tokens: int) -> bool:
    """Whether `held`'s replica can answer `handoff` from its own prefix cache: every image
    position in blocks it holds, and at most `max_tokens` prompt tokens left to compute."""
    cached = held.blocks_held * block_size
    images_end = max((span.offset + span.length for *_, span in handoff.items()), default=0)
    return (held.instance is not None and held.blocks_held > 0 and cached >= images_end
            and len(handoff.token_ids) - cached <= max_tokens)
