"""An engine request's steps as the DecodeChunks a caller streams: the KV deadline, the
fail-closed outcome as KVCoverageError, and the answer's statistics. Used by decode, agg and the
full-media arm alike, so their answers look the same to the frontend."""

from __future__ import annotations

import asyncio
import time
from typing import Any, AsyncIterator

from mmhandoff.engine import Engine
from mmhandoff.wire.messages import DecodeChunk, DecodeStats


class KVCoverageError(RuntimeError):
    """The request's KV did not cover every image span; nothing was recomputed from media."""

    code = "kv_coverage"
    fault = "server"

    def __init__(self, request_id: str, cause: str) -> None:
        super().__init__(f"request {request_id}: KV does not cover the image spans ({cause})")
        self.request_id = request_id
        self.cause = cause


async def stream_answer(engine: Engine, request: Any, request_id: str, engine_request_id: str, *,
                        kv_deadline_s: float | None, request_bytes: int, prepare_ms: float,
                        t0: float, media_ms: float = -1.0, admitted_at: float = 0.0,
                        sent_in_prompt: int = 0) -> AsyncIterator[DecodeChunk]:
    """`kv_deadline_s` bounds the wait for the first token (the KV pull happens before it);
    None: no bound (nothing to pull). `t0`: when the caller got the request (perf_counter);
    `admitted_at`: when it admitted it (unix time). `sent_in_prompt`: answer tokens at the end of
    the engine's prompt (prefill's first token) that the answer's usage counts as completion."""
    steps = engine.generate(request, engine_request_id)
    ttft_ms = None
    try:
        while True:
            try:
                if ttft_ms is None:
                    step = await asyncio.wait_for(anext(steps), kv_deadline_s)
                else:
                    step = await anext(steps)
            except StopAsyncIteration:
                return
            except asyncio.TimeoutError:
                raise KVCoverageError(
                    request_id, f"kv_deadline: no KV within {kv_deadline_s:g} s") from None
            if step.kv_failure is not None:
                raise KVCoverageError(request_id, step.kv_failure)
            if ttft_ms is None:
                ttft_ms = (time.perf_counter() - t0) * 1e3
            stats = None
            if step.finished:
                kv = step.kv_stats
                stats = DecodeStats(
                    request_bytes=request_bytes, prepare_ms=prepare_ms, media_ms=media_ms,
                    ttft_ms=ttft_ms,
                    admitted_at=admitted_at, prompt_tokens=step.prompt_tokens - sent_in_prompt,
                    kv_tokens_local=kv.get("local", -1),
                    kv_tokens_pulled=kv.get("external", -1),
                    kv_positions_covered=kv.get("covered", -1))
            yield DecodeChunk(request_id=request_id, token_ids=step.token_ids, text=step.text,
                              finish_reason=step.finish_reason, stats=stats,
                              logprobs=step.logprobs, prompt_logprobs=step.prompt_logprobs)
            if step.finished:
                return
    finally:
        # An early end (error, deadline, a caller gone) aborts the request, which frees its
        # blocks; aborting a finished request is a no-op.
        await steps.aclose()
        await engine.abort(engine_request_id)


async def collect(chunks: AsyncIterator[DecodeChunk]) -> tuple[list[int], DecodeChunk]:
    """All token ids of a decode stream, and its last chunk (finish reason and stats)."""
    tokens: list[int] = []
    last = None
    async for chunk in chunks:
        tokens.extend(chunk.token_ids)
        last = chunk
    assert last is not None
    return tokens, last
