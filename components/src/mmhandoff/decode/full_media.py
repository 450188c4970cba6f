"""The benchmark arm in which decode receives the images and re-processes them, as P/D stacks do
today (`--full-media`). Not part of the product's decode path: it shares only the streaming."""

from __future__ import annotations

import asyncio
import time
from contextlib import aclosing
import uuid
from typing import AsyncIterator

import msgspec

from mmhandoff.engine import Engine
from mmhandoff.engine.stream import stream_answer
from mmhandoff.media.images import decode_image
from mmhandoff.media.videos import LoadedVideo, content_hash
from mmhandoff.wire.messages import DecodeChunk, FullMediaRequest


class InvalidFullMedia(ValueError):
    code = "invalid_request"
    fault = "server"  # prefill made it: a bad one is ours


class FullMediaDecodeWorker:
    """Needs an engine with the vision tower; the same KV deadline and answer as decode."""

    def __init__(self, engine: Engine, *, kv_deadline_s: float | None = 30.0) -> None:
        self.engine = engine
        self.kv_deadline_s = kv_deadline_s

    async def generate(self, message: bytes) -> AsyncIterator[DecodeChunk]:
        t0 = time.perf_counter()
        request = msgspec.msgpack.decode(message, type=FullMediaRequest)
        images = await asyncio.to_thread(lambda: [decode_image(b) for b in request.images])
        videos = await asyncio.gather(*(asyncio.to_thread(self._video, b)
                                        for b in request.videos))
        rendered = await self.engine.render(request.prompt, [*images, *videos])
        engine_request = self.engine.request(
            rendered, request.sampling, kv_transfer_params=dict(request.kv_transfer_params))
        prepare_ms = (time.perf_counter() - t0) * 1e3
        engine_request_id = f"{request.request_id}:decode-full:{uuid.uuid4().hex[:8]}"
        async with aclosing(stream_answer(
                self.engine, engine_request, request.request_id, engine_request_id,
                kv_deadline_s=self.kv_deadline_s, request_bytes=len(message),
                prepare_ms=prepare_ms, t0=t0)) as chunks:
            async for chunk in chunks:
                yield chunk

    def _video(self, data: bytes) -> LoadedVideo:
        """The video as prefill loaded it: the engine's own loader, the same identity."""
        import base64

        frames, metadata = self.engine.load_video(
            f"data:video/mp4;base64,{base64.b64encode(data).decode()}")
        return LoadedVideo((frames, metadata), content_hash(frames, metadata), len(data))

    async def warm_up(self) -> None:  # the engine's warm-up is all this arm needs
        pass

    async def handle(self, request: dict) -> AsyncIterator[dict]:
        try:  # the wire form carries image bytes as base64 text
            typed = msgspec.convert(request, FullMediaRequest)
        except msgspec.ValidationError as e:
            raise InvalidFullMedia(f"invalid full-media request: {e}") from None
        async with aclosing(self.generate(msgspec.msgpack.encode(typed))) as chunks:
            async for chunk in chunks:
                yield msgspec.to_builtins(chunk)
