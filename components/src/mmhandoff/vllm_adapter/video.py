"""A video's frames as vLLM's server samples them for the engine's model.

vLLM's chat server loads a `video_url` through its MediaConnector with the loader registered for
the model's video processor (Qwen2-VL's and Qwen3-VL's sample by rate, at 2 frames a second
by default, and return the metadata their processors read: rate, frame indices, duration), and
the engine's `--media-io-kwargs` for video. Prefill calls the same, so the frames it renders are
the ones `vllm serve` would render for the same bytes.

vLLM internals used (both in 0.26 and 0.31): MediaConnector.fetch_video(url, video_processor=)
and get_video_processor_cls_name(model_config); 0.31 wraps the result in MediaWithBytes
(`.media`), 0.26 returns the (frames, metadata) pair itself.
"""

from __future__ import annotations

from typing import Any


def load_video(llm, data_uri: str) -> tuple[Any, dict[str, Any]]:
    """(frames: T x H x W x 3 uint8, metadata) of a `data:video/...;base64,` URI; ValueError
    for data vLLM's loader cannot read."""
    from vllm.multimodal.media.connector import MediaConnector
    from vllm.transformers_utils.processor import get_video_processor_cls_name

    mc = llm.model_config
    kwargs = getattr(mc.multimodal_config, "media_io_kwargs", None) or None
    try:
        loaded = MediaConnector(media_io_kwargs=kwargs).fetch_video(
            data_uri, video_processor=get_video_processor_cls_name(mc))
    except ValueError:
        raise
    except Exception as e:  # noqa: BLE001 (OpenCV's and the loaders' own errors: bad data)
        raise ValueError(f"{type(e).__name__}: {e}") from None
    frames, metadata = getattr(loaded, "media", loaded)
    if getattr(frames, "ndim", 0) != 4 or not len(frames):
        raise ValueError("no frames could be read")
    return frames, dict(metadata)
