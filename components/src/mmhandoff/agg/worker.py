"""Aggregated worker: the whole VLM in one engine, chat request in, tokens out.

It is the agg graph's only worker and the reference the disaggregated answers must equal token
for token at temperature 0. It renders exactly as the prefill worker does (same template, same
image identity) and streams exactly as the decode worker does (same chunks and stats).
"""

from __future__ import annotations

import time
import uuid
from typing import AsyncIterator

import msgspec

from mmhandoff.decode.worker import DecodeWorker
from mmhandoff.prefill.worker import InvalidRequest, PrefillWorker
from mmhandoff.vllm_adapter import render_prompt, sampling_params
from mmhandoff.wire.messages import DecodeChunk, PrefillRequest


class AggWorker(DecodeWorker):
    def __init__(self, engine) -> None:
        super().__init__(engine, kv_deadline_s=None)  # nothing to pull: no KV deadline
        self.renderer = PrefillWorker(engine)

    async def generate(self, request: PrefillRequest, rendered: tuple[str, list[str]] | None = None
                       ) -> AsyncIterator[DecodeChunk]:
        t0 = time.perf_counter()
        prompt, images = await self.renderer.prepare(request, rendered)
        rendered = await render_prompt(self.engine, prompt, [i.image for i in images],
                                       [i.content_hash for i in images])
        prepare_ms = (time.perf_counter() - t0) * 1e3
        engine_request_id = f"{request.request_id}:agg:{uuid.uuid4().hex[:8]}"
        async for chunk in self._stream(request.request_id, rendered.engine_input,
                                        sampling_params(request.sampling), engine_request_id,
                                        0, prepare_ms, t0):
            yield chunk

    async def handle(self, request: dict) -> AsyncIterator[dict]:
        """Dynamo endpoint handler: a PrefillRequest (data-URI images) in, DecodeChunks out."""
        typed, prompt, refs = self.renderer.from_wire(request)
        async for chunk in self.generate(typed, (prompt, refs)):
            yield msgspec.to_builtins(chunk)


ENDPOINT = "agg.generate"


def main(argv: list[str] | None = None) -> int:
    from mmhandoff.media.images import ImageError
    from mmhandoff.serving.launch import run

    def make_handler(engine, args):
        return AggWorker(engine).handle

    return run("agg", "agg", ENDPOINT, make_handler, (ImageError, InvalidRequest), argv)


if __name__ == "__main__":
    raise SystemExit(main())
