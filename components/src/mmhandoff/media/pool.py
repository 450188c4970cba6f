"""Images prepared in processes of their own (issue 37: media preparation scales with cores).

A first-seen image costs its worker the data URI's base64, the decode, the identity hash and the
model's image processor: ~250 ms of one core for a 12 MP JPEG on the GPU host. In threads of the
worker's process those steps hold the GIL for part of their time (base64, PIL's copies, the
processor's Python), and vLLM's renderer runs every image's processor on one thread: eight such
images at once queued for seconds on a 16-core host. Here each image is decoded, hashed and
brought to the processor's resize size (media.presize: the same model input) in one of N
processes; the worker's process gets back the identity and a small image (a 12 MP photo for
LLaVA: 336 x 448), which vLLM's renderer processes in a few milliseconds.

The processes are spawned (the worker's process runs threads of its own: fork is unsafe), all at
start, from the worker's main thread, and each dies with its parent (process.parent_death). If
one dies anyway, the pool is broken: the worker says so in its log and loads images in its own
threads from then on, as it does with no pool.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool

from mmhandoff.media.images import ImageLimits, LoadedImage, load_image_ref
from mmhandoff.media.presize import Presizer

log = logging.getLogger(__name__)

AUTO_MAX = 8  # processes "auto" starts at most: a 12 MP image each keeps C8 near C1
AUTO_MIN_CORES = 8  # below this, "auto" starts none (the CPU tests' hosts: 2 cores)


def host_cores() -> int:
    return len(os.sched_getaffinity(0))


def auto_workers(cores: int | None = None) -> int:
    """Half the process's cores, at most AUTO_MAX; none on a host of fewer than AUTO_MIN_CORES
    (its cores are the engine's: the CPU tests' vLLM)."""
    cores = host_cores() if cores is None else cores
    return min(AUTO_MAX, cores // 2) if cores >= AUTO_MIN_CORES else 0


# one media process's state, set by _start
_presizer: Presizer | None = None


def _start(presizer: Presizer | None, torch_threads: int) -> None:
    from mmhandoff.process.parent_death import die_with_parent

    die_with_parent()
    global _presizer
    _presizer = presizer
    if presizer is not None:  # the processor's resize runs on torch's intra-op threads
        import torch

        torch.set_num_threads(torch_threads)


def _ready() -> int:
    return os.getpid()


def _load_image(ref: str, limits: ImageLimits) -> LoadedImage:
    item = load_image_ref(ref, limits)
    if _presizer is None:
        return item
    return LoadedImage(_presizer(item.image), item.content_hash, item.source_bytes)


class MediaPool:
    def __init__(self, workers: int, presizer: Presizer | None = None) -> None:
        if workers < 1:
            raise ValueError(f"a media pool needs at least one process, not {workers}")
        self.workers = workers
        self.presizes = presizer is not None
        threads = max(1, host_cores() // workers)
        self._pool = ProcessPoolExecutor(
            workers, mp_context=multiprocessing.get_context("spawn"), initializer=_start,
            initargs=(presizer, threads))
        self._broken = False

    def start(self) -> list[int]:
        """Every process started and ready (blocks: seconds, importing torch), from the calling
        thread, which must live as long as the process (the main thread): each process is
        signalled to die when it ends. The processes' pids."""
        # each call finds no idle process (none has finished a task yet) and spawns one
        futures = [self._pool.submit(_ready) for _ in range(self.workers)]
        return [f.result() for f in futures]

    def load_image(self, ref: str, limits: ImageLimits) -> LoadedImage:
        """`load_image_ref(ref, limits)` in a media process, the image presized; blocks (call it
        from a thread). The image's own errors (ImageError) are raised here as there."""
        if not self._broken:
            try:
                return self._pool.submit(_load_image, ref, limits).result()
            except BrokenProcessPool:
                self._broken = True
                log.error("[mmhandoff] a media process died: images are loaded in the "
                          "worker's threads from now on")
        return load_image_ref(ref, limits)

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
