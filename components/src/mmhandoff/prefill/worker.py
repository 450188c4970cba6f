"""Encode/prefill worker: the whole VLM; turns a chat request with images into a Handoff.

It renders the messages, gives every image its content hash as identifier, runs prefill with
`max_tokens=1` and `do_remote_decode` (the NIXL producer then holds the blocks until decode pulls
them or the lease ends), and answers with a Handoff that carries no media.
"""

from __future__ import annotations

import time
from contextlib import aclosing
import uuid
from typing import AsyncIterator

import msgspec

from mmhandoff.engine import Engine, EngineInputError
from mmhandoff.media.images import ImageError, ImageLimits, data_uri_bytes
from mmhandoff.prefill.prompt import InvalidRequest, PromptBuilder
from mmhandoff.wire.handoff import VERSION, Handoff, sign
from mmhandoff.wire.messages import (
    FullMediaRequest,
    PrefillAnswer,
    PrefillRequest,
    PrefillStats,
)

__all__ = ["InvalidRequest", "PrefillError", "PrefillWorker"]


# How long a signed handoff stays valid. It only has to outlive the trip to decode and decode's
# queue; prefill holds the blocks for its KV lease, and a handoff past that is useless anyway.
HANDOFF_TTL_S = 120.0


class PrefillError(RuntimeError):
    code = "prefill_failed"
    fault = "server"


class PrefillWorker:
    """`full_media=True` is the benchmark arm in which decode gets the media again: the endpoint
    then answers with a FullMediaRequest (prompt text and image bytes) instead of a Handoff."""

    def __init__(self, engine: Engine, *, limits: ImageLimits = ImageLimits(),
                 full_media: bool = False, key: bytes | None = None,
                 ttl_s: float = HANDOFF_TTL_S) -> None:
        """`key`: sign every handoff with it, with a nonce and an expiry `ttl_s` from now
        (decode is given the same key)."""
        self.engine = engine
        self.prompts = PromptBuilder(engine, limits)
        self.full_media = full_media
        self.key, self.ttl_s = key, ttl_s

    async def generate(self, request: PrefillRequest
                       ) -> AsyncIterator[tuple[Handoff, PrefillStats]]:
        t0 = time.perf_counter()
        images = await self.prompts.images(request)
        rendered = await self.engine.render(self.prompts.text(request), images)
        if request.continuation:
            if self.full_media:  # its decode renders the prompt text again: it would be lost
                raise PrefillError("the full-media arm does not continue an answer")
            rendered = self.engine.extend(rendered, request.continuation)
        t1 = time.perf_counter()
        engine_request = self.engine.request(rendered, request.sampling, max_tokens=1,
                                             kv_transfer_params={"do_remote_decode": True},
                                             cache_salt=request.cache_salt)
        final = None
        engine_request_id = f"{request.request_id}:prefill:{uuid.uuid4().hex[:8]}"
        async with aclosing(self.engine.generate(engine_request, engine_request_id)) as steps:
            async for step in steps:
                final = step
        if final is None or not final.kv_transfer_params:
            raise PrefillError(f"prefill of {request.request_id} returned no KV transfer params")
        handoff = Handoff(
            v=VERSION,
            request_id=request.request_id,
            model_fingerprint=self.engine.fingerprint,
            token_ids=rendered.token_ids,
            features=rendered.features,
            requires_kv=True,
            kv_transfer_params=final.kv_transfer_params,
            sampling=request.sampling,
            cache_salt=request.cache_salt,
            continued=len(request.continuation),
        )
        if self.key is not None:
            handoff = sign(handoff, self.key, ttl_s=self.ttl_s)
        stats = PrefillStats(
            images=len(images), image_bytes=sum(i.source_bytes for i in images),
            prompt_tokens=len(rendered.token_ids), prepare_ms=(t1 - t0) * 1e3,
            prefill_ms=(time.perf_counter() - t1) * 1e3,
        )
        yield handoff, stats

    async def handle(self, request: dict) -> AsyncIterator[dict]:
        """Dynamo endpoint handler: a PrefillRequest in its builtin form in, one PrefillAnswer
        out."""
        typed = self.prompts.from_wire(request)
        handoff, stats = await self.handoff(typed)
        if self.full_media:
            answer = PrefillAnswer(stats=stats, full_media=FullMediaRequest(
                request_id=typed.request_id, prompt=self.prompts.text(typed),
                images=[data_uri_bytes(u, self.prompts.limits) for u in typed.image_urls()],
                kv_transfer_params=handoff.kv_transfer_params, sampling=typed.sampling))
        else:
            answer = PrefillAnswer(handoff=handoff, stats=stats)
        yield msgspec.to_builtins(answer)

    async def handoff(self, request: PrefillRequest) -> tuple[Handoff, PrefillStats]:
        async with aclosing(self.generate(request)) as items:
            async for item in items:
                return item
        raise PrefillError("prefill produced nothing")


ENDPOINT = "prefill.generate"
ERRORS = (ImageError, InvalidRequest, EngineInputError, PrefillError)


def main(argv: list[str] | None = None) -> int:
    from mmhandoff.serving.launch import run

    def make_handler(engine, args):
        key = args.handoff_keys[0] if args.handoff_keys else None  # the first key signs
        return PrefillWorker(engine, full_media=args.full_media, key=key).handle

    return run("prefill", "prefill", ENDPOINT, make_handler, ERRORS, argv)


if __name__ == "__main__":
    raise SystemExit(main())
