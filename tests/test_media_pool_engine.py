"""Images prepared in media processes (media.pool) give vLLM's renderer the same work to do as
images prepared in the worker's threads: the same token ids, spans and processed tensors, bit
for bit, and each path's identities as media.images defines them (media processes hash the
presized pixels), with the presizer the engine itself checked (tiny LLaVA on vLLM's CPU
engine; the Qwen families: test_qwen2_vl.py). And the pool's own behaviour: typed errors from
its processes, a dead process not losing requests, nothing left running after close."""

from __future__ import annotations

import io
import os
import signal

import psutil
import pytest
from PIL import Image

from mmhandoff.engine.fake import FakeEngine
from mmhandoff.engine.prompt import PromptBuilder
from mmhandoff.media.images import (
    PRESIZED_DOMAIN,
    ImageLimits,
    ImageTooLarge,
    InvalidBase64,
    content_hash,
    data_uri_bytes,
    load_image_ref,
)
from mmhandoff.media.pool import MediaPool
from tests.conftest import chat, data_uri, encode, make_image
from tests.flows import assert_identities, assert_same_tensors, pooled_identity, rendered_input

pytestmark = pytest.mark.engine


@pytest.fixture(scope="module")
def builders(engines):
    """The prefill engine's PromptBuilder with a media process, and one without."""
    pooled = PromptBuilder(engines.prefill, pool=MediaPool(1))
    pooled.start()
    yield pooled, PromptBuilder(engines.prefill)
    pooled.close()


def exif_turned_jpeg(seed: int) -> bytes:
    exif = Image.Exif()
    exif[0x0112] = 6  # stored on its side: shown turned 90 degrees
    buf = io.BytesIO()
    make_image(900, 500, seed).save(buf, format="JPEG", quality=92, exif=exif.tobytes())
    return buf.getvalue()


CASES = {
    "2000x1500-jpeg": lambda: [(encode(make_image(2000, 1500, 41), "JPEG"), "image/jpeg")],
    "333x500-png": lambda: [(encode(make_image(333, 500, 42)), "image/png")],
    "exif-turned-jpeg": lambda: [(exif_turned_jpeg(43), "image/jpeg")],
    "two-images": lambda: [(encode(make_image(1200, 300, 44)), "image/png"),
                           (encode(make_image(640, 480, 45), "JPEG"), "image/jpeg")],
}


def test_the_engine_checked_its_presizer(engines, builders):
    pooled, _ = builders
    assert engines.prefill.presizer() is not None
    assert pooled.pool is not None and pooled.pool.presizes


@pytest.mark.parametrize("case", list(CASES))
def test_images_from_the_pool_are_the_same_engine_input(loop, builders, case):
    pooled, threads = builders
    messages = chat("What is in the pictures?",
                    *(data_uri(b, mime) for b, mime in CASES[case]()))
    ids_a, features_a, tensors_a = rendered_input(loop, pooled, f"pool-{case}", messages)
    ids_b, features_b, tensors_b = rendered_input(loop, threads, f"threads-{case}", messages)
    assert ids_a == ids_b
    assert_identities(features_a, features_b, messages, pooled.engine.presizer())
    assert_same_tensors(tensors_a, tensors_b)


def test_a_drafted_jpeg_is_the_same_prompt_its_input_a_measured_bit_off(loop, engines, builders):
    """--image-decode draft through vLLM's render: the same token ids and spans as the exact
    decode, in media processes and in threads alike; the processed tensors off by no more
    than test_presize's bounds (the processor alone), and another identity."""
    from tests.test_presize import DRAFT_BOUND, DRAFT_MEAN_BOUND

    _, exact = builders
    pooled = PromptBuilder(engines.prefill, pool=MediaPool(1), image_decode="draft")
    threads = PromptBuilder(engines.prefill, image_decode="draft")
    pooled.start()
    threads.start()
    try:
        assert pooled.draft == threads.draft == (224, 224)  # the tiny CLIP's 112 px, twice
        messages = chat("What is in it?",
                        data_uri(encode(make_image(2000, 1500, 49), "JPEG"), "image/jpeg"))
        ids_p, features_p, tensors_p = rendered_input(loop, pooled, "draft-pool", messages)
        ids_t, features_t, tensors_t = rendered_input(loop, threads, "draft-threads", messages)
        ids_e, features_e, tensors_e = rendered_input(loop, exact, "draft-exact", messages)
        assert ids_p == ids_t == ids_e
        assert_identities(features_p, features_t, messages, pooled.engine.presizer(),
                          draft=pooled.draft)  # the drafted pixels' own identities
        assert features_e.mm_hashes["image"][0] not in (features_p.mm_hashes["image"]
                                                        + features_t.mm_hashes["image"])
        assert_same_tensors(tensors_p, tensors_t)
        (drafted,), (whole,) = tensors_p, tensors_e
        diff = (drafted["pixel_values"] - whole["pixel_values"]).abs()
        assert 0 < float(diff.max()) <= DRAFT_BOUND and float(diff.mean()) <= DRAFT_MEAN_BOUND
    finally:
        pooled.close()
        threads.close()


def test_the_pool_sends_the_processor_a_small_image(builders):
    pooled, _ = builders
    ref = data_uri(encode(make_image(2000, 1500, 46), "JPEG"), "image/jpeg")
    item = pooled.pool.load_image(ref, ImageLimits())
    assert item.image.width * item.image.height <= 0.5 * 2000 * 1500
    whole = load_image_ref(ref)
    # the identity of the presized pixels (media.images), not of the whole image's
    assert item.content_hash == content_hash(item.image, PRESIZED_DOMAIN) != whole.content_hash
    assert item.content_hash == pooled_identity(pooled.engine.presizer(), data_uri_bytes(ref))
    assert item.source_bytes == whole.source_bytes


def test_errors_come_back_typed_from_the_pool(builders):
    pool = builders[0].pool
    for bad in ("data:image/png;base64,!!!!", b"data:image/png;base64,!!!!"):
        with pytest.raises(InvalidBase64):
            pool.load_image(bad, ImageLimits())
    with pytest.raises(ImageTooLarge):
        pool.load_image(data_uri(encode(make_image(300, 200, 1))), ImageLimits(max_pixels=1000))


def test_a_dead_media_process_loses_no_request_and_close_leaves_nothing(loop):
    """Without a presizer (the fake engine has none) the pool decodes and hashes only."""
    prompts = PromptBuilder(FakeEngine(), pool=MediaPool(1))
    prompts.start()
    pool = prompts.pool
    assert not pool.presizes
    (pid,) = pool.start()  # started already: the same process answers
    ref = data_uri(encode(make_image(320, 240, 47)))
    expected = load_image_ref(ref)
    assert pool.load_image(ref, ImageLimits()) == expected
    os.kill(pid, signal.SIGKILL)
    psutil.Process(pid).wait(10)
    assert pool.load_image(ref, ImageLimits()) == expected  # in this process's thread now
    prompts.close()
    assert pid not in {c.pid for c in psutil.Process().children(recursive=True)}


class RecordingPresizer:
    """A presizer that halves images and writes a line to a file named after each process
    that unpickles it."""

    def __init__(self, folder: str) -> None:
        self.folder = folder

    def __setstate__(self, state) -> None:
        self.__dict__.update(state)
        with open(os.path.join(self.folder, str(os.getpid())), "a") as f:
            f.write("unpickled\n")

    def __call__(self, image):
        return image.resize((image.width // 2, image.height // 2))


def test_the_presizer_reaches_processes_spawned_before_it(tmp_path):
    """The processes are spawned before the engine starts and get the presizer after it, with
    each task: every image is presized, and each process unpickles it once (seconds of imports
    for a real processor), not per image."""
    pool = MediaPool(3).spawn()
    try:
        pids = set(pool.start(RecordingPresizer(str(tmp_path))))
        assert pool.presizes
        refs = [data_uri(encode(make_image(320, 240, 48 + i))) for i in range(9)]
        for ref in refs:
            item = pool.load_image(ref, ImageLimits())
            assert item.image.size == (160, 120)
            halved = load_image_ref(ref).image.resize((160, 120))  # the presizer's work, here
            assert item.content_hash == content_hash(halved, PRESIZED_DOMAIN)
            assert pool.load_image(ref.encode(), ImageLimits()) == item  # a URI sent as bytes
        children = {c.pid for c in psutil.Process().children(recursive=True)}
        records = {int(f.name): f.read_text() for f in tmp_path.iterdir()}
        assert records and set(records) <= children and pids <= children
        assert set(records.values()) == {"unpickled\n"}
    finally:
        pool.close()


def test_a_media_process_dies_with_its_worker():
    """process.parent_death: a worker killed by SIGKILL leaves no media process behind."""
    import subprocess
    import sys

    code = ("from mmhandoff.media.pool import MediaPool\n"
            "pool = MediaPool(1)\n"
            "print(pool.start()[0], flush=True)\n"
            "import signal\n"
            "signal.pause()\n")  # until killed
    worker = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        child = psutil.Process(int(worker.stdout.readline()))
        worker.kill()
        worker.wait(10)
        child.wait(10)  # psutil.TimeoutExpired if it outlived the worker
    finally:
        worker.kill()
