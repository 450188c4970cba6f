"""Decode worker: admits a Handoff, pulls its KV through NIXL, streams tokens. Never sees media.

Admission (mmhandoff.wire.handoff) refuses bad messages before the engine sees them. The engine's
fail-closed scheduler refuses to compute any image position; when it does, or when the KV load
fails, or when the first token misses the KV deadline, the request ends with `KVCoverageError`
naming the cause and the engine stays healthy. The caller may retry the whole request through
prefill.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import AsyncIterator

import msgspec

from mmhandoff.media.images import decode_image
from mmhandoff.vllm_adapter import (
    kv_coverage_cause,
    kv_only_request,
    kv_stats,
    model_fingerprint,
    render_prompt,
    sampling_params,
)
from mmhandoff.wire.handoff import (
    Handoff,
    check_admission,
    decode_handoff,
    encode_handoff,
)
from mmhandoff.wire.messages import DecodeChunk, DecodeStats, FullMediaRequest


class KVCoverageError(RuntimeError):
    """The request's KV did not cover every image span; nothing was recomputed from media."""

    code = "kv_coverage"
    fault = "server"

    def __init__(self, request_id: str, cause: str) -> None:
        super().__init__(f"request {request_id}: KV does not cover the image spans ({cause})")
        self.request_id = request_id
        self.cause = cause


class InvalidRequest(ValueError):
    """The request as the client sent it cannot run (e.g. longer than the model's context)."""

    code = "invalid_request"
    fault = "client"


class UnsupportedModel(RuntimeError):
    pass


class DecodeWorker:
    def __init__(self, engine, *, kv_deadline_s: float | None = 30.0,
                 key: bytes | None = None) -> None:
        mc = engine.model_config
        if mc.uses_mrope:
            raise UnsupportedModel("M-RoPE models derive positions from the media; a KV-only "
                                   "decode cannot rebuild them (a later handoff version will)")
        if mc.is_encoder_decoder:
            raise UnsupportedModel("encoder-decoder models need the encoder output on decode")
        self.engine = engine
        self.kv_deadline_s = kv_deadline_s
        self.key = key
        self.fingerprint = model_fingerprint(engine)
        self._tasks: tuple | None = None

    def admit(self, message: Handoff | bytes) -> tuple[Handoff, int]:
        """Decode (if bytes) and check a handoff; raise a HandoffError if it is refused."""
        if isinstance(message, Handoff):
            wire = encode_handoff(message)
            handoff = decode_handoff(wire)  # the same checks as off the wire
        else:
            wire = bytes(message)
            handoff = decode_handoff(wire)
        check_admission(handoff, fingerprint=self.fingerprint, key=self.key)
        return handoff, len(wire)

    async def generate(self, message: Handoff | bytes) -> AsyncIterator[DecodeChunk]:
        if self._tasks is None:
            self._tasks = tuple(await self.engine.get_supported_tasks())
        t0 = time.perf_counter()
        handoff, size = self.admit(message)
        engine_request_id = f"{handoff.request_id}:decode:{uuid.uuid4().hex[:8]}"
        try:
            request = kv_only_request(self.engine, handoff, engine_request_id, self._tasks)
        except ValueError as e:  # vLLM's own input checks (e.g. longer than max_model_len)
            raise InvalidRequest(f"request {handoff.request_id}: {e}") from None
        prepare_ms = (time.perf_counter() - t0) * 1e3
        async for chunk in self._stream(handoff.request_id, request, request.sampling_params,
                                        engine_request_id, size, prepare_ms, t0):
            yield chunk

    async def _stream(self, request_id, engine_input, params, engine_request_id, size, prepare_ms,
                      t0) -> AsyncIterator[DecodeChunk]:
        stream = self.engine.generate(engine_input, params, engine_request_id)
        ttft_ms = None
        sent_ids = sent_text = 0
        try:
            while True:
                try:
                    if ttft_ms is None:  # the KV pull happens before the first token: bound it
                        output = await asyncio.wait_for(anext(stream), self.kv_deadline_s)
                    else:
                        output = await anext(stream)
                except StopAsyncIteration:
                    return
                except asyncio.TimeoutError:
                    raise KVCoverageError(
                        request_id, f"kv_deadline: no KV within {self.kv_deadline_s:g} s") from None
                if output.finished and (cause := kv_coverage_cause(output)) is not None:
                    raise KVCoverageError(request_id, cause)
                if ttft_ms is None:
                    ttft_ms = (time.perf_counter() - t0) * 1e3
                completion = output.outputs[0]
                # vLLM hands out its live token list (it keeps growing while we are suspended
                # in `yield`): take the counts now, not after the yield.
                token_ids, text = list(completion.token_ids), completion.text
                new_ids, new_text = token_ids[sent_ids:], text[sent_text:]
                sent_ids, sent_text = len(token_ids), len(text)
                stats = None
                if output.finished:
                    kv = kv_stats(output)
                    stats = DecodeStats(
                        request_bytes=size, prepare_ms=prepare_ms, ttft_ms=ttft_ms,
                        prompt_tokens=len(output.prompt_token_ids or ()),
                        kv_tokens_local=kv.get("local", -1),
                        kv_tokens_pulled=kv.get("external", -1),
                        kv_positions_covered=kv.get("covered", -1))
                yield DecodeChunk(request_id=request_id, token_ids=new_ids, text=new_text,
                                  finish_reason=completion.finish_reason, stats=stats)
                if output.finished:
                    return
        finally:
            # Closing the stream early (error, deadline, cancelled caller) aborts the request in
            # vLLM, which frees its blocks; aborting a finished request is a no-op.
            await stream.aclose()
            await self.engine.abort(engine_request_id)

    async def handle(self, request: dict) -> AsyncIterator[dict]:
        """Dynamo endpoint handler: a handoff in its builtin form in, DecodeChunk dicts out."""
        async for chunk in self.generate(msgspec.msgpack.encode(request)):
            yield msgspec.to_builtins(chunk)


class FullMediaDecodeWorker(DecodeWorker):
    """The benchmark arm where decode receives the images and re-processes them, as P/D stacks
    do today. Same streaming and KV deadline; needs an engine with the vision tower."""

    async def handle(self, request: dict) -> AsyncIterator[dict]:
        try:  # the wire form carries image bytes as base64 text
            typed = msgspec.convert(request, FullMediaRequest)
        except msgspec.ValidationError as e:
            raise InvalidRequest(f"invalid full-media request: {e}") from None
        async for chunk in self.generate(msgspec.msgpack.encode(typed)):
            yield msgspec.to_builtins(chunk)

    async def generate(self, message: bytes) -> AsyncIterator[DecodeChunk]:
        t0 = time.perf_counter()
        request = msgspec.msgpack.decode(message, type=FullMediaRequest)
        images = await asyncio.to_thread(lambda: [decode_image(b) for b in request.images])
        rendered = await render_prompt(self.engine, request.prompt, [i.image for i in images],
                                       [i.content_hash for i in images])
        params = sampling_params(request.sampling,
                                 kv_transfer_params=dict(request.kv_transfer_params))
        prepare_ms = (time.perf_counter() - t0) * 1e3
        engine_request_id = f"{request.request_id}:decode-full:{uuid.uuid4().hex[:8]}"
        async for chunk in self._stream(request.request_id, rendered.engine_input, params,
                                        engine_request_id, len(message), prepare_ms, t0):
            yield chunk


async def collect(chunks: AsyncIterator[DecodeChunk]) -> tuple[list[int], DecodeChunk]:
    """All token ids of a decode stream, and its last chunk (finish reason and stats)."""
    tokens: list[int] = []
    last = None
    async for chunk in chunks:
        tokens.extend(chunk.token_ids)
        last = chunk
    assert last is not None
    return tokens, last


ENDPOINT = "decode.generate"


def main(argv: list[str] | None = None) -> int:
    from mmhandoff.serving.launch import run
    from mmhandoff.wire.handoff import HandoffError

    def make_handler(engine, args):
        worker = FullMediaDecodeWorker if args.full_media else DecodeWorker
        return worker(engine, kv_deadline_s=args.kv_deadline_s).handle

    return run("decode", lambda a: "full_media_decode" if a.full_media else "decode",
               ENDPOINT, make_handler, (HandoffError, KVCoverageError, InvalidRequest), argv)


if __name__ == "__main__":
    raise SystemExit(main())
