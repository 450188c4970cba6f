"""Encode/prefill worker: the whole VLM; turns a chat request with images into a Handoff.

It renders the messages, gives every image its content hash as identifier, runs prefill with
`max_tokens=1` and `do_remote_decode` (the NIXL producer then holds the blocks until decode pulls
them or the lease ends), and answers with a Handoff that carries no media.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any, AsyncIterator

import msgspec

from mmhandoff.media.images import (
    ImageError,
    ImageLimits,
    LoadedImage,
    data_uri_bytes,
    load_image_ref,
)
from mmhandoff.vllm_adapter import model_fingerprint, render_prompt, sampling_params
from mmhandoff.wire.handoff import VERSION, Handoff
from mmhandoff.wire.messages import (
    FullMediaRequest,
    PrefillAnswer,
    PrefillRequest,
    PrefillStats,
)


class PrefillError(RuntimeError):
    code = "prefill_failed"
    fault = "server"


class InvalidRequest(ValueError):
    code = "invalid_request"
    fault = "client"


def split_messages(messages: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[str]]:
    """Chat messages with image parts replaced by `{"type": "image"}`, and the image refs in order."""
    if not isinstance(messages, list) or not messages:
        raise ImageError("messages must be a non-empty list")
    refs: list[str] = []
    out = []
    for message in messages:
        if not isinstance(message, dict) or "role" not in message:
            raise ImageError("each message needs a role")
        content = message.get("content")
        if isinstance(content, list):
            parts = []
            for part in content:
                kind = part.get("type") if isinstance(part, dict) else None
                if kind == "image_url":
                    url = part.get("image_url")
                    refs.append(url.get("url") if isinstance(url, dict) else url)
                    parts.append({"type": "image"})
                elif kind == "image":
                    refs.append(part.get("image"))
                    parts.append({"type": "image"})
                elif kind == "text":
                    parts.append({"type": "text", "text": str(part.get("text", ""))})
                else:
                    raise ImageError(f"unsupported content part type {kind!r}")
            message = {**message, "content": parts}
        out.append(message)
    if any(not isinstance(r, str) or not r for r in refs):
        raise ImageError("an image part has no URL or path")
    return out, refs


class PrefillWorker:
    """`full_media=True` is the benchmark arm in which decode gets the media again: the endpoint
    then answers with a FullMediaRequest (prompt text and image bytes) instead of a Handoff."""

    def __init__(self, engine, *, limits: ImageLimits = ImageLimits(),
                 full_media: bool = False) -> None:
        self.engine = engine
        self.limits = limits
        self.full_media = full_media
        self.fingerprint = model_fingerprint(engine)
        self.tokenizer = engine.renderer.get_tokenizer()

    async def prepare(self, request: PrefillRequest,
                      rendered: tuple[str, list[str]] | None = None) -> tuple[str, list[LoadedImage]]:
        """The prompt text and the decoded images (off the event loop: decoding is CPU work).
        `rendered`: the prompt and image refs when the caller already has them (from_wire)."""
        prompt, refs = rendered or self._prompt(request)
        images = await asyncio.to_thread(lambda: [load_image_ref(r, self.limits) for r in refs])
        return prompt, images

    def _prompt(self, request: PrefillRequest) -> tuple[str, list[str]]:
        if request.prompt is not None:  # completions: the text as given, no template, no images
            if request.messages:
                raise InvalidRequest("give messages or prompt, not both")
            return request.prompt, []
        messages, refs = split_messages(request.messages)
        return self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True), refs

    async def generate(self, request: PrefillRequest, rendered: tuple[str, list[str]] | None = None
                       ) -> AsyncIterator[tuple[Handoff, PrefillStats]]:
        t0 = time.perf_counter()
        prompt, images = await self.prepare(request, rendered)
        rendered = await render_prompt(
            self.engine, prompt, [i.image for i in images], [i.content_hash for i in images])
        t1 = time.perf_counter()
        params = sampling_params(request.sampling, max_tokens=1,
                                 kv_transfer_params={"do_remote_decode": True})
        final = None
        engine_request_id = f"{request.request_id}:prefill:{uuid.uuid4().hex[:8]}"
        async for output in self.engine.generate(rendered.engine_input, params, engine_request_id):
            final = output
        if final is None or not final.kv_transfer_params:
            raise PrefillError(f"prefill of {request.request_id} returned no KV transfer params")
        handoff = Handoff(
            v=VERSION,
            request_id=request.request_id,
            model_fingerprint=self.fingerprint,
            token_ids=rendered.token_ids,
            features=rendered.features,
            requires_kv=True,
            kv_transfer_params=final.kv_transfer_params,
            sampling=request.sampling,
            cache_salt=request.cache_salt,
        )
        stats = PrefillStats(
            images=len(images), image_bytes=sum(i.source_bytes for i in images),
            prompt_tokens=len(rendered.token_ids), prepare_ms=(t1 - t0) * 1e3,
            prefill_ms=(time.perf_counter() - t1) * 1e3,
        )
        yield handoff, stats

    async def handle(self, request: dict) -> AsyncIterator[dict]:
        """Dynamo endpoint handler: a PrefillRequest in its builtin form in, one PrefillAnswer
        out."""
        typed, prompt, refs = self.from_wire(request)
        async for handoff, stats in self.generate(typed, (prompt, refs)):
            if self.full_media:
                answer = PrefillAnswer(stats=stats, full_media=FullMediaRequest(
                    request_id=typed.request_id, prompt=prompt,
                    images=[data_uri_bytes(r, self.limits) for r in refs],
                    kv_transfer_params=handoff.kv_transfer_params, sampling=typed.sampling))
            else:
                answer = PrefillAnswer(handoff=handoff, stats=stats)
            yield msgspec.to_builtins(answer)

    def from_wire(self, request: dict) -> tuple[PrefillRequest, str, list[str]]:
        """A PrefillRequest off the network, its prompt text and its image refs; a network
        caller does not get to name files on this host, so images must be data URIs."""
        try:
            typed = msgspec.convert(request, PrefillRequest, strict=True)
        except msgspec.ValidationError as e:
            raise InvalidRequest(f"invalid request: {e}") from None
        prompt, refs = self._prompt(typed)
        if any(not r.startswith("data:") for r in refs):
            raise InvalidRequest("images must be data URIs")
        return typed, prompt, refs

    async def handoff(self, request: PrefillRequest) -> tuple[Handoff, PrefillStats]:
        async for item in self.generate(request):
            return item
        raise PrefillError("prefill produced nothing")


ENDPOINT = "prefill.generate"


def main(argv: list[str] | None = None) -> int:
    from mmhandoff.serving.launch import run

    def make_handler(engine, args):
        return PrefillWorker(engine, full_media=args.full_media).handle

    return run("prefill", "prefill", ENDPOINT, make_handler,
               (ImageError, InvalidRequest, PrefillError), argv)


if __name__ == "__main__":
    raise SystemExit(main())
