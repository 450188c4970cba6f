"""Video intake: what the frontend checks before a video goes on, and a video's identity.

The decoder is OpenCV (`opencv-python-headless`, through its bundled FFmpeg): vLLM's own default
video loader, already installed with vLLM, so prefill's frames are sampled by exactly the code
`vllm serve` runs (vllm_adapter.video) and the frontend's probe reads the same container the
same way. The frontend only probes: it opens the container and reads its header (frame count,
rate, size), which costs milliseconds and decodes no frame.

A video's identity hashes the frames the model sees (the sampled frames' pixels and the
metadata the processor reads: rate, indices, duration), as an image's hashes its pixels: the same
clip in other bytes gets one identity, and so its KV blocks are shared.
"""

from __future__ import annotations

import io
import json
from dataclasses import dataclass
from typing import Any

from blake3 import blake3

from mmhandoff.media.images import ImageError, ImageTooLarge

HASH_DOMAIN = b"mmhandoff.video.v1\0"


class InvalidVideo(ImageError):
    code = "invalid_video"


class VideoTooLarge(ImageTooLarge):
    code = "video_too_large"


class VideoTooLong(ImageError):
    code = "video_too_long"


@dataclass(frozen=True)
class VideoLimits:
    max_bytes: int = 32 * 1024 * 1024
    max_duration_s: float = 600.0
    max_frames: int = 36_000  # ten minutes at 60 frames a second
    max_pixels: int = 3840 * 2160  # per frame: 4K


@dataclass(frozen=True)
class VideoInfo:
    width: int
    height: int
    frames: int
    fps: float

    @property
    def duration_s(self) -> float:
        return self.frames / self.fps


def container(data: bytes) -> str | None:
    """The video container `data` starts as, by its magic bytes: "mp4" (ISO media: MP4, MOV,
    3GP), "matroska" (MKV, WebM) or "avi"; None for anything else."""
    if data[4:8] == b"ftyp":
        return "mp4"
    if data[:4] == b"\x1a\x45\xdf\xa3":
        return "matroska"
    if data[:4] == b"RIFF" and data[8:12] == b"AVI ":
        return "avi"
    return None


CONTAINERS = ("mp4", "matroska", "avi")


def probe_video(data: bytes) -> VideoInfo:
    """The container's frame size, frame count and rate, no frame decoded; InvalidVideo when
    it is not a video OpenCV can read. Only the containers above reach OpenCV: for anything
    else FFmpeg would guess a format among all it knows (images, playlists, ...), a surface
    client bytes need not reach."""
    import cv2

    if container(data) is None:
        raise InvalidVideo(f"data is not a video in a supported container "
                           f"({', '.join(CONTAINERS)})")
    stream = io.BytesIO(data)  # referenced until released: OpenCV reads it then (else: SIGSEGV)
    cap = cv2.VideoCapture(stream, cv2.CAP_FFMPEG, [])
    try:
        if not cap.isOpened():
            raise InvalidVideo("data is not a readable video")
        frames, fps = cap.get(cv2.CAP_PROP_FRAME_COUNT), cap.get(cv2.CAP_PROP_FPS)
        width, height = cap.get(cv2.CAP_PROP_FRAME_WIDTH), cap.get(cv2.CAP_PROP_FRAME_HEIGHT)
    finally:
        cap.release()
    if not (0 < frames < 2**31 and 0 < fps <= 1000 and width >= 1 and height >= 1):
        raise InvalidVideo("data is not a readable video (no frame count, rate or size)")
    return VideoInfo(int(width), int(height), int(frames), float(fps))


def check_video(info: VideoInfo, limits: VideoLimits) -> None:
    if info.width * info.height > limits.max_pixels:
        raise VideoTooLarge(f"video frames are {info.width}x{info.height} pixels; the limit is "
                            f"{limits.max_pixels}")
    if info.frames > limits.max_frames:
        raise VideoTooLong(f"video has {info.frames} frames; the limit is {limits.max_frames}")
    if info.duration_s > limits.max_duration_s:
        raise VideoTooLong(f"video lasts {info.duration_s:.1f} s; the limit is "
                           f"{limits.max_duration_s:g} s")


@dataclass(frozen=True)
class LoadedVideo:
    # (frames as a T x H x W x 3 uint8 array, the metadata vLLM's loader gave); None: not
    # decoded, because the engine holds it processed (engine.prompt's memo)
    video: tuple[Any, dict[str, Any]] | None
    content_hash: str
    source_bytes: int
    modality = "video"

    @property
    def data(self):
        return self.video


def content_hash(frames, metadata: dict[str, Any]) -> str:
    """BLAKE3 of the sampled frames' shape and pixels and of the metadata the processor reads."""
    import numpy as np

    frames = np.ascontiguousarray(frames)
    h = blake3(HASH_DOMAIN, max_threads=blake3.AUTO)
    h.update(f"{frames.dtype}:{'x'.join(map(str, frames.shape))}\0".encode())
    h.update(json.dumps(metadata, sort_keys=True, default=str).encode() + b"\0")
    h.update(memoryview(frames).cast("B"))
    return h.hexdigest()
