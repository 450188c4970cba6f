"""From a PrefillRequest to what an engine renders: the prompt text (the model's chat template
over the typed messages) and the decoded images. Shared by prefill and agg, so both render a
request exactly alike (the parity of the two graphs depends on it)."""

from __future__ import annotations

import asyncio
from typing import Any

import msgspec

from mmhandoff.engine import Engine
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


class PromptBuilder:
    def __init__(self, engine: Engine, limits: ImageLimits = ImageLimits()) -> None:
        self.engine = engine
        self.limits = limits

    def text(self, request: PrefillRequest) -> str:
        if request.prompt is not None:  # completions: the text as given, no template, no images
            return request.prompt
        return self.engine.chat_prompt(conversation(request.messages))

    async def images(self, request: PrefillRequest) -> list[LoadedImage]:
        """Decoded off the event loop: decoding is CPU work."""
        refs = request.image_urls()
        return await asyncio.to_thread(lambda: [load_image_ref(r, self.limits) for r in refs])

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
