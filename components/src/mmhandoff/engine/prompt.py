"""From a PrefillRequest to what an engine renders: the prompt text (the model's chat template
over the typed messages) and the decoded images and videos (a video's frames sampled by the
engine, as its own server samples them). Shared by prefill and agg, so both render a request
exactly alike (the parity of the two graphs depends on it).

An image sent again as the same data URI (a follow-up turn, another question about it) is not
decoded again: a memo maps each data URI's blake3 to the content hash and size its decode gave,
and the image goes to the engine without pixels, which vLLM's cache of processed images then
supplies (a 12 MP JPEG: ~190 ms of decoding and pixel hashing become ~1.5 ms of blake3). If the
engine no longer holds it (PixelsNeeded), the images are decoded and rendered again. The same
bytes always decode to the same pixels, so the content hash, and every block hash after it, are
the decode's. Videos go the same way.

With a media pool (media.pool), a first-seen image is decoded, hashed and presized in one of the
pool's processes instead of a thread of this one."""

from __future__ import annotations

import asyncio
import base64
import logging
import threading
import time
from collections import OrderedDict
from pathlib import Path
from typing import Any

import msgspec
from blake3 import blake3

from mmhandoff.engine import Engine, PixelsNeeded, Rendered
from mmhandoff.media.images import (
    ImageLimits,
    ImageTooLarge,
    LoadedImage,
    data_uri_bytes,
    load_image_ref,
)
from mmhandoff.media.pool import MediaPool
from mmhandoff.media.videos import (
    InvalidVideo,
    LoadedVideo,
    VideoLimits,
    VideoTooLarge,
    content_hash,
)
from mmhandoff.wire.messages import ChatMessage, ImagePart, PrefillRequest, VideoPart, media_url


log = logging.getLogger(__name__)


class InvalidRequest(ValueError):
    code = "invalid_request"
    fault = "client"


def conversation(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """The messages in the form chat templates take: image parts become `{"type": "image"}`,
    video parts `{"type": "video"}`."""
    def part(p) -> dict[str, Any]:
        if isinstance(p, ImagePart):
            return {"type": "image"}
        if isinstance(p, VideoPart):
            return {"type": "video"}
        return {"type": "text", "text": p.text}

    return [{"role": m.role, "content": m.content if isinstance(m.content, str) else [
        part(p) for p in m.content]} for m in messages]


Media = LoadedImage | LoadedVideo


# how a first-seen image is decoded: "exact" (every pixel; the model's input is vLLM's own), or
# "draft" (a JPEG at a reduced scale where the processor resizes to a fixed short side anyway:
# ~2.5x less CPU for a 12 MP photo, the model's input off by up to ~0.09; off by default)
IMAGE_DECODES = ("exact", "draft")

DECODED_MEMO = 4096  # data URIs whose decode the memo remembers (~150 bytes each)


class PromptBuilder:
    def __init__(self, engine: Engine, limits: ImageLimits = ImageLimits(),
                 video_limits: VideoLimits = VideoLimits(),
                 pool: MediaPool | None = None, image_decode: str = "exact") -> None:
        """`pool`: the processes that prepare images (media.pool), ready after `start`; None:
        this process's threads do. `image_decode`: "exact", or "draft" (IMAGE_DECODES) from
        `start` on, where the engine's processor allows it."""
        if image_decode not in IMAGE_DECODES:
            raise ValueError(f"image_decode must be one of {', '.join(IMAGE_DECODES)}, "
                             f"not {image_decode!r}")
        self.engine = engine
        self.limits = limits
        self.video_limits = video_limits
        self.pool = pool
        self.image_decode = image_decode
        self.draft: tuple[int, int] | None = None  # the JPEG decode's least size (images.py)
        # blake3 of a data URI -> (content hash, byte size) of its decode, least recent first
        self._decoded: OrderedDict[str, tuple[str, int]] = OrderedDict()
        self._lock = threading.Lock()  # images are loaded in worker threads

    def start(self) -> None:
        """The media processes, ready, presizing as this engine's processor does, and the draft
        decode's size if asked for (blocks; call it from the main thread, unless the pool was
        spawned already: see media.pool)."""
        if self.pool is None and self.image_decode == "exact":
            return
        presizer = self.engine.presizer()
        if self.image_decode == "draft":
            self.draft = presizer.draft_size() if presizer is not None else None
            log.warning("[mmhandoff] " + (
                f"JPEGs decoded inexactly, at {self.draft[0]} px a side or more "
                "(--image-decode draft: the model's input differs by up to ~0.09)"
                if self.draft else "--image-decode draft: this model's image processor would "
                "change the input's shape: images are decoded exactly"))
        if self.pool is not None:
            t0 = time.monotonic()
            self.pool.start(presizer)
            log.info(f"[mmhandoff] {self.pool.workers} media process(es) prepare images, "
                     f"{'presized' if self.pool.presizes else 'at their own size'} "
                     f"(ready {time.monotonic() - t0:.1f} s after the engine)")

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()
            self.pool = None

    def text(self, request: PrefillRequest) -> str:
        if request.prompt is not None:  # completions: the text as given, no template, no images
            return request.prompt
        return self.engine.chat_prompt(conversation(request.messages))

    async def media(self, request: PrefillRequest, *, decode: bool = False) -> list[Media]:
        """The request's images and videos in prompt order, off the event loop and each in its
        own worker thread (decoding and hashing release the GIL: a request's items are prepared
        side by side, as are concurrent requests'); one whose data URI was decoded before comes
        without its data, unless `decode`."""
        return list(await asyncio.gather(*(
            asyncio.to_thread(self._load, media_url(part), isinstance(part, VideoPart), decode)
            for part in request.media())))

    async def render(self, request: PrefillRequest, media: list[Media]) -> Rendered:
        """The engine's render of the request's prompt with `media` (from `media`)."""
        try:
            return await self.engine.render(self.text(request), media)
        except PixelsNeeded:  # the engine no longer holds an item sent without its data
            return await self.engine.render(self.text(request),
                                            await self.media(request, decode=True))

    def _load(self, ref: str, video: bool, decode: bool) -> Media:
        raw = ref.encode() if ref.startswith("data:") else None
        key = blake3(raw).hexdigest() if raw is not None else None
        with self._lock:
            known = self._decoded.get(key) if key is not None and not decode else None
            if known is not None:
                self._decoded.move_to_end(key)
        if known is not None:
            return (LoadedVideo if video else LoadedImage)(None, *known)
        if video:
            item = self._load_video(ref)
        elif self.pool is not None:  # (as bytes: media.pool)
            item = self.pool.load_image(ref if raw is None else raw, self.limits, self.draft)
        else:
            item = load_image_ref(ref, self.limits, self.draft)
        if key is not None:  # (a file's contents may change: not remembered)
            with self._lock:
                self._decoded[key] = (item.content_hash, item.source_bytes)
                if len(self._decoded) > DECODED_MEMO:
                    self._decoded.popitem(last=False)
        return item

    def _load_video(self, ref: str) -> LoadedVideo:
        """A video (a data URI; in-process callers: a local file) as the engine samples it."""
        if ref.startswith("data:"):
            try:
                size = len(data_uri_bytes(ref, ImageLimits(max_bytes=self.video_limits.max_bytes)))
            except ImageTooLarge:
                raise VideoTooLarge(f"video is over the {self.video_limits.max_bytes}-byte "
                                    "limit") from None
        else:  # a local file, for in-process callers: sent on as a data URI
            path = Path(ref[len("file://"):] if ref.startswith("file://") else ref)
            try:
                data = path.read_bytes()
            except OSError as e:
                raise InvalidVideo(f"cannot read video file {str(path)!r}: {e.strerror}") from None
            size, ref = len(data), f"data:video/mp4;base64,{base64.b64encode(data).decode()}"
        try:
            frames, metadata = self.engine.load_video(ref)
        except ValueError as e:
            raise InvalidVideo(f"data is not a readable video: {e}") from None
        return LoadedVideo((frames, metadata), content_hash(frames, metadata), size)

    @staticmethod
    def from_wire(request: Any) -> PrefillRequest:
        """A PrefillRequest off the network. A network caller does not get to name files on this
        host, so images and videos must be data URIs."""
        try:
            typed = msgspec.convert(request, PrefillRequest, strict=True)
        except msgspec.ValidationError as e:
            raise InvalidRequest(f"invalid request: {e}") from None
        if any(not media_url(p).startswith("data:") for p in typed.media()):
            raise InvalidRequest("images and videos must be data URIs")
        return typed
