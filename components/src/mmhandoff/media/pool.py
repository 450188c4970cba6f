"""Images prepared in processes of their own (issue 37: media preparation scales with cores).

A first-seen image costs its worker the data URI's base64, the decode, the identity hash and the
model's image processor: ~250 ms of one core for a 12 MP JPEG on the GPU host. In threads of the
worker's process those steps hold the GIL for part of their time (base64, PIL's copies, the
processor's Python), and vLLM's renderer runs every image's processor on one thread: eight such
images at once queued for seconds on a 16-core host. Here each image is decoded, brought to
the processor's resize size (media.presize: the same model input) and hashed in that form
(media.images: still an identity of the model's input) in one of N processes; the worker's
process gets back the identity and a small image (a 12 MP photo for LLaVA: 336 x 448), which
vLLM's renderer processes in a few milliseconds.

The processes are spawned (the worker's process runs threads of its own: fork is unsafe), all at
start, from the worker's main thread, and each dies with its parent (process.parent_death). If
one dies anyway, the pool is broken: the worker says so in its log and loads images in its own
threads from then on, as it does with no pool.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import pickle
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool

from mmhandoff.media.images import (
    PRESIZED_DOMAIN,
    ImageLimits,
    LoadedImage,
    content_hash,
    load_image_ref,
    read_image_ref,
)
from mmhandoff.media.presize import Presizer

log = logging.getLogger(__name__)

AUTO_MAX = 8  # processes "auto" starts at most: a 12 MP image each keeps C8 near C1
AUTO_MIN_CORES = 8  # below this, "auto" starts none (the CPU tests' hosts: 2 cores)


def host_cores() -> int:
    from mmhandoff.process.cores import usable_cores

    return usable_cores()


def auto_workers(cores: int | None = None) -> int:
    """Half the process's cores (its affinity, at most its cgroup's CPU quota), at most
    AUTO_MAX; none on a host of fewer than AUTO_MIN_CORES (its cores are the engine's: the CPU
    tests' vLLM)."""
    cores = host_cores() if cores is None else cores
    return min(AUTO_MAX, cores // 2) if cores >= AUTO_MIN_CORES else 0


# what unpickling an image processor imports, whatever the model (~1.5 s): imported at the
# process's start, beside the engine's, so that its first image pays only the model's own module
PROCESSOR_IMPORTS = ("torch", "torchvision.transforms.v2", "transformers.image_utils",
                     "transformers.image_processing_utils",
                     "transformers.image_processing_utils_fast")

# one media process's state: the presizer its last task named (pickled, and unpickled)
_presizer: tuple[bytes, Presizer] | None = None


def _start(torch_threads: int) -> None:
    import importlib

    from mmhandoff.process.parent_death import die_with_parent

    die_with_parent()
    for name in PROCESSOR_IMPORTS:
        try:
            importlib.import_module(name)
        except ImportError:  # another transformers' layout: the first image imports the rest
            pass
    import torch

    torch.set_num_threads(torch_threads)  # its intra-op threads: this process's share


def _ready(presizer: bytes | None) -> int:
    _presizer_of(presizer)
    return os.getpid()


def _text(ref: str | bytes) -> str:
    return ref.decode() if isinstance(ref, bytes) else ref


def _presizer_of(pickled: bytes | None) -> Presizer | None:
    global _presizer
    if pickled is None:
        return None
    if _presizer is None or _presizer[0] != pickled:
        _presizer = (pickled, pickle.loads(pickled))
    return _presizer[1]


def prepare_image(ref: str | bytes, limits: ImageLimits, presizer: bytes | None,
                  draft: tuple[int, int] | None) -> LoadedImage:
    """A media process's work on one image: decoded, presized by the pickled `presizer` (None:
    not at all) and given its identity."""
    presize = _presizer_of(presizer)
    if presize is None:
        return load_image_ref(_text(ref), limits, draft)
    image, size = read_image_ref(_text(ref), limits, draft)
    small = presize(image)
    # the identity of what the model sees, over the presized pixels where there are fewer
    # (media.images says why that stays an identity)
    return LoadedImage(small, content_hash(image) if small is image
                       else content_hash(small, PRESIZED_DOMAIN), size)


class MediaPool:
    def __init__(self, workers: int) -> None:
        if workers < 1:
            raise ValueError(f"a media pool needs at least one process, not {workers}")
        self.workers = workers
        self._presizer: bytes | None = None  # pickled: ~1 KB with each task
        self._pool = ProcessPoolExecutor(
            workers, mp_context=multiprocessing.get_context("spawn"), initializer=_start,
            initargs=(max(1, host_cores() // workers),))
        self._spawned: list | None = None
        self._broken = False

    @property
    def presizes(self) -> bool:
        return self._presizer is not None

    def spawn(self) -> MediaPool:
        """Start every process (returns at once; they import torch meanwhile), from the calling
        thread, which must live as long as the process (the main thread): each process is
        signalled to die when it ends. The engine's start goes on beside them. Each process
        imports the caller's `__main__` module again (multiprocessing's spawn): a script that
        makes a pool needs its `if __name__ == "__main__":` guard, as mmhandoff's own have."""
        if self._spawned is None:
            # each call finds no idle process (none has finished a task yet) and spawns one
            self._spawned = [self._pool.submit(_ready, None) for _ in range(self.workers)]
        return self

    def start(self, presizer: Presizer | None = None) -> list[int]:
        """Every process started and ready, images presized by `presizer` from now on (blocks:
        seconds, if `spawn` came just before). The processes' pids."""
        pids = [f.result() for f in self.spawn()._spawned]
        self._presizer = None if presizer is None else pickle.dumps(presizer)
        if self._presizer is not None:  # one each, most likely: a process unpickles it once
            for f in [self._pool.submit(_ready, self._presizer) for _ in range(self.workers)]:
                f.result()
        return pids

    def load_image(self, ref: str | bytes, limits: ImageLimits,
                   draft: tuple[int, int] | None = None) -> LoadedImage:
        """`load_image_ref(ref, limits, draft)` in a media process, the image presized; blocks
        (call it from a thread). `ref` may come UTF-8 encoded: a large data URI crosses to the
        process as bytes much faster than as a str (pickled: 0.6 against 8.6 ms for a 12 MP
        JPEG's 7.8 MB on the 2-core host, on the worker's one feeder thread, under its GIL).
        The image's own errors (ImageError) are raised here as there."""
        if not self._broken:
            try:
                return self._pool.submit(prepare_image, ref, limits, self._presizer,
                                         draft).result()
            except BrokenProcessPool:
                self._broken = True
                log.error("[mmhandoff] a media process died: images are loaded in the "
                          "worker's threads from now on")
        return load_image_ref(_text(ref), limits, draft)

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
