"""Aggregated worker: the whole VLM in one engine, chat request in, tokens out.

It is the agg graph's only worker and the reference the disaggregated answers must equal token
for token at temperature 0. It renders exactly as the prefill worker does (the same
PromptBuilder) and streams exactly as the decode worker does (the same stream_answer), but
takes none of decode's refusals: it computes everything itself.
"""

from __future__ import annotations

import time
from contextlib import aclosing
import uuid
from typing import AsyncIterator

import msgspec

from mmhandoff.engine import Engine, EngineInputError
from mmhandoff.engine.prompt import InvalidRequest, PromptBuilder
from mmhandoff.engine.stream import stream_answer
from mmhandoff.media.images import ImageError
from mmhandoff.media.pool import MediaPool
from mmhandoff.plane.endpoints import generate
from mmhandoff.wire.messages import DecodeChunk, PrefillRequest


class AggWorker:
    def __init__(self, engine: Engine, pool: MediaPool | None = None,
                 image_decode: str = "exact") -> None:
        self.engine = engine
        self.prompts = PromptBuilder(engine, pool=pool, image_decode=image_decode)

    async def generate(self, request: PrefillRequest) -> AsyncIterator[DecodeChunk]:
        t0 = time.perf_counter()
        media = await self.prompts.media(request)
        media_ms = (time.perf_counter() - t0) * 1e3
        rendered = await self.prompts.render(request, media)
        if request.continuation:
            rendered = self.engine.extend(rendered, request.continuation)
        prepare_ms = (time.perf_counter() - t0) * 1e3
        engine_request_id = f"{request.request_id}:agg:{uuid.uuid4().hex[:8]}"
        async with aclosing(stream_answer(
                self.engine, self.engine.request(rendered, request.sampling,
                                                 cache_salt=request.cache_salt,
                                                 continued=len(request.continuation),
                                                 prompt_logprobs=request.prompt_logprobs),
                request.request_id, engine_request_id, kv_deadline_s=None, request_bytes=0,
                prepare_ms=prepare_ms, media_ms=media_ms, t0=t0)) as chunks:
            async for chunk in chunks:
                yield chunk

    async def warm_up(self) -> None:
        self.prompts.start()

    def close(self) -> None:
        self.prompts.close()

    async def handle(self, request: dict) -> AsyncIterator[dict]:
        """Dynamo endpoint handler: a PrefillRequest (data-URI images) in, DecodeChunks out."""
        async with aclosing(self.generate(self.prompts.from_wire(request))) as chunks:
            async for chunk in chunks:
                yield msgspec.to_builtins(chunk)


ENDPOINT = generate("agg")


# what a client's request may fail with here (typed 4xx); anything else is ours (5xx)
ERRORS = (ImageError, InvalidRequest, EngineInputError)


def main(argv: list[str] | None = None) -> int:
    from mmhandoff.process.engine_worker import run

    return run("agg", "agg", ENDPOINT,
               lambda engine, context: AggWorker(engine, context.media_pool,
                                                 context.args.image_decode), ERRORS, argv)


if __name__ == "__main__":
    raise SystemExit(main())
