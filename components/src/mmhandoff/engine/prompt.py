"""From a PrefillRequest to what an engine renders: the prompt text (the model's chat template
over the typed messages) and the decoded images. Shared by prefill and agg, so both render a
request exactly alike (the parity of the two graphs depends on it).

An image sent again as the same data URI (a follow-up turn, another question about it) is not
decoded again: a memo maps each data URI's blake3 to the content hash and size its decode gave,
and the image goes to the engine without pixels, which vLLM's cache of processed images then
supplies (a 12 MP JPEG: ~190 ms of decoding and pixel hashing become ~1.5 ms of blake3). If the
engine no longer holds it (PixelsNeeded), the images are decoded and rendered again. The same
bytes always decode to the same pixels, so the content hash, and every block hash after it, are
the decode's."""

from __future__ import annotations

import asyncio
import threading
from collections import OrderedDict
from typing import Any

import msgspec
from blake3 import blake3

from mmhandoff.engine import Engine, PixelsNeeded, Rendered
from mmhandoff.media.images import ImageLimits, LoadedImage, load_image_ref
from mmhandoff.wire.messages import ChatMessage, ImagePart, PrefillRequest


class InvalidRequest(ValueError):
    code = "invalid_request"
    fault = "client"


def conversation(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """The messages in the form chat templates take: image parts become `{"type": "image"}`."""
    return [{"role": m.role, "content": m.content if isinstance(m.content, str) else [
        {"type": "image"} if isinstance(p, ImagePart) else {"type": "text", "text": p.text}
        for p in m.content]} for m in messages]


DECODED_MEMO = 4096  # data URIs whose decode the memo remembers (~150 bytes each)


class PromptBuilder:
    def __init__(self, engine: Engine, limits: ImageLimits = ImageLimits()) -> None:
        self.engine = engine
        self.limits = limits
        # blake3 of a data URI -> (content hash, byte size) of its decode, least recent first
        self._decoded: OrderedDict[str, tuple[str, int]] = OrderedDict()
        self._lock = threading.Lock()  # images are loaded in worker threads

    def text(self, request: PrefillRequest) -> str:
        if request.prompt is not None:  # completions: the text as given, no template, no images
            return request.prompt
        return self.engine.chat_prompt(conversation(request.messages))

    async def images(self, request: PrefillRequest, *, decode: bool = False) -> list[LoadedImage]:
        """The request's images, off the event loop and each in its own worker thread (decoding
        and hashing release the GIL: a request's images are prepared side by side, as are
        concurrent requests'); one whose data URI was decoded before comes without pixels,
        unless `decode`."""
        return list(await asyncio.gather(*(asyncio.to_thread(self._load, ref, decode)
                                           for ref in request.image_urls())))

    async def render(self, request: PrefillRequest, images: list[LoadedImage]) -> Rendered:
        """The engine's render of the request's prompt with `images` (from `images`)."""
        try:
            return await self.engine.render(self.text(request), images)
        except PixelsNeeded:  # the engine no longer holds an image sent without pixels
            return await self.engine.render(self.text(request),
                                            await self.images(request, decode=True))

    def _load(self, ref: str, decode: bool) -> LoadedImage:
        key = blake3(ref.encode()).hexdigest() if ref.startswith("data:") else None
        with self._lock:
            known = self._decoded.get(key) if key is not None and not decode else None
            if known is not None:
                self._decoded.move_to_end(key)
        if known is not None:
            return LoadedImage(None, *known)
        image = load_image_ref(ref, self.limits)
        if key is not None:  # (a file's contents may change: not remembered)
            with self._lock:
                self._decoded[key] = (image.content_hash, image.source_bytes)
                if len(self._decoded) > DECODED_MEMO:
                    self._decoded.popitem(last=False)
        return image

    @staticmethod
    def from_wire(request: Any) -> PrefillRequest:
        """A PrefillRequest off the network. A network caller does not get to name files on this
        host, so images must be data URIs."""
        try:
            typed = msgspec.convert(request, PrefillRequest, strict=True)
        except msgspec.ValidationError as e:
            raise InvalidRequest(f"invalid request: {e}") from None
        if any(not url.startswith("data:") for url in typed.image_urls()):
            raise InvalidRequest("images must be data URIs")
        return typed
