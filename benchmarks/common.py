"""Helpers the benchmarks share: free ports, photo-like JPEGs and video clips, percentiles,
peak memory."""

from __future__ import annotations

import io
import threading


def port() -> int:
    from mmhandoff.plane.ports import free_port  # outside the ephemeral range: see there

    return free_port()


def jpeg(width: int, height: int, seed: int) -> bytes:
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    base = np.stack([x / width, y / height, (x + y) / (width + height)], -1) * 255
    img = np.clip(base * rng.uniform(0.3, 1, 3) + rng.normal(0, 20, (height, width, 3)), 0, 255)
    buf = io.BytesIO()
    Image.fromarray(img.astype(np.uint8)).save(buf, format="JPEG", quality=90)
    return buf.getvalue()


def mp4(width: int, height: int, frames: int, fps: float, seed: int) -> bytes:
    """An MPEG-4 (mp4v) clip written by OpenCV: a seed-tinted, noisy gradient with a square that
    moves a step each frame (so the frames differ; the noise stays, so that frames compress
    against each other as a camera's do: 8 s of 720p is ~1 MB). The same arguments, the same
    bytes."""
    import tempfile
    from pathlib import Path

    import cv2
    import numpy as np

    rng = np.random.default_rng(seed)
    tint = rng.uniform(0.3, 1.0, size=3).astype(np.float32)
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    base = np.stack([(x / width) * 255, (y / height) * 255, ((x + y) / (width + height)) * 255], -1)
    base = base * tint + rng.normal(0, 12, size=base.shape)
    side = max(4, min(width, height) // 4)
    with tempfile.TemporaryDirectory() as tmp:
        path = f"{tmp}/clip.mp4"
        writer = cv2.VideoWriter(path, cv2.VideoWriter_fourcc(*"mp4v"), fps, (width, height))
        if not writer.isOpened():
            raise RuntimeError("OpenCV cannot write mp4v here")
        for i in range(frames):
            frame = base.copy()
            left = i * (width - side) // max(frames - 1, 1)
            frame[height // 3:height // 3 + side, left:left + side] = 255 * (1 - tint)
            writer.write(np.clip(frame, 0, 255).astype(np.uint8))
        writer.release()
        return Path(path).read_bytes()


class PeakRSS:
    """Samples the resident memory of each engine's processes (engine core + workers)."""

    def __init__(self) -> None:
        import psutil

        self.me = psutil.Process()
        self.groups: dict[str, set[int]] = {}
        self.peak: dict[str, int] = {}
        self._stop = threading.Event()
        threading.Thread(target=self._run, daemon=True).start()

    def children(self) -> set[int]:
        return {p.pid for p in self.me.children(recursive=True)}

    def add(self, name: str, pids: set[int]) -> None:
        self.groups[name] = pids
        self.peak[name] = 0

    def _run(self) -> None:
        import psutil

        while not self._stop.wait(0.2):
            for name, pids in list(self.groups.items()):
                total = 0
                for pid in pids:
                    try:
                        total += psutil.Process(pid).memory_info().rss
                    except psutil.Error:
                        pass
                self.peak[name] = max(self.peak[name], total)

    def stop(self) -> None:
        self._stop.set()


def pct(values, q):
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q / 100 * (len(values) - 1))))]
