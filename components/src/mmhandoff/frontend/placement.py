"""Which prefill replica takes a request: the frontend asks the router (router.place) before
prefill, with an identity of each image's (and video's) prefix that costs no decode.

`image_keys(request)`: one key per image or video, in prompt order. Key i hashes what the
rendered prompt holds up to item i's end, as the client sent it: the cache salt, each message's
role and text, and the bytes of every item up to and including item i. A chat template renders
messages in order, so two requests with the same key i share the prompt, and so the engine's KV
blocks, through item i. Prefill workers publish which engine blocks a key stands for
(prefill.prefixes), routers keep it (router.prefix_table) and place the next request with that
key on the prefill replica that holds them (a template that looked ahead would only make
placement worse, never an answer wrong: a route decides where KV is computed, not what).

A repeated image is recognised here when its bytes are the same: the same file fetched again, or
the same data URI (its media type included). The same pixels in other bytes (re-encoded,
resized) are still found by each engine's own prefix cache (vLLM hashes decoded pixels), but do
not steer the placement.
"""

from __future__ import annotations

import asyncio
import logging

import msgspec
from blake3 import blake3

from mmhandoff.plane.runtime import RemoteError, call_one
from mmhandoff.wire.messages import (
    ImagePart,
    Placement,
    PlaceRequest,
    PrefillRequest,
    VideoPart,
    media_url,
)

log = logging.getLogger(__name__)

PLACE_TIMEOUT_S = 1.0  # a router slower than this is skipped: Dynamo's round robin instead
_PERSON = b"mmhandoff image prefix v1\0"  # the keys' format: change it when what they cover does


def image_keys(request: PrefillRequest) -> list[str]:
    """One hex key per image or video of a chat request (none for a raw completions prompt)."""
    chain = blake3(_PERSON)
    chain.update(b"salt\0" + (request.cache_salt or "").encode() + b"\0")
    keys = []
    for message in request.messages:
        chain.update(b"role\0" + message.role.encode() + b"\0")
        for part in message.parts():
            if isinstance(part, (ImagePart, VideoPart)):
                # the data URI (the frontend made every URL one) stands for the item's bytes;
                # blake3: ~4x sha256's speed, and no copy but the encoding
                kind = b"image\0" if isinstance(part, ImagePart) else b"video\0"
                chain.update(kind + blake3(media_url(part).encode()).digest())
                keys.append(chain.copy().hexdigest(16))
            else:
                text = part.text.encode()
                chain.update(b"text\0" + len(text).to_bytes(8, "little") + text)
    return keys


class PrefillPlacement:
    """Asks router.place for a request's prefill instance. The router is a hint: when it is
    away, slow or names an instance that has gone, the request goes round robin. A router
    instance that fails at once (one killed, still in discovery until its lease ends) is asked
    no more for this request: the next one is (Dynamo's round robin), within the same time."""

    def __init__(self, place, prefill, timeout_s: float = PLACE_TIMEOUT_S) -> None:
        self.place, self.prefill = place, prefill  # Dynamo clients: router.place, prefill
        self.timeout_s = timeout_s
        self._warned = False

    def asks(self, keys: list[str]) -> bool:
        """Whether there is anything to ask: an image to name, and replicas to choose from."""
        return bool(keys) and len(self.prefill.instance_ids()) >= 2

    async def instance(self, request: PrefillRequest, keys: list[str]) -> int | None:
        if not self.asks(keys):
            return None
        ask = msgspec.to_builtins(PlaceRequest(request_id=request.request_id, image_keys=keys))
        try:
            placement = await asyncio.wait_for(self._ask(ask), self.timeout_s)
        except Exception as e:  # noqa: BLE001 (any failure: round robin, said once)
            if not self._warned:
                self._warned = True
                log.warning(f"[frontend] router.place failed ({e!r}): prefill round robin until it "
                            f"answers")
            return None
        self._warned = False
        if placement.instance not in self.prefill.instance_ids():
            return None
        return placement.instance

    async def _ask(self, ask: dict) -> Placement:
        """router.place's answer, from the next router instance if the first fails."""
        try:
            raw = await call_one(self.place, ask, lost="router_failed")
        except RemoteError:  # that instance is gone or failing: Dynamo's next one
            raw = await call_one(self.place, ask, lost="router_failed")
        return msgspec.convert(raw, Placement)
