"""On a GPU host only: the handoff with a real-size shape (LLaVA-1.5-7B layout, dummy weights),
prefill, decode and the full-media decode engine sharing one GPU. The `gpu` tier: CI's CPU run
does not select it; on the lent H200 it runs through the wheel bundle (docs/gpu.md):

    scripts/gpu/device.sh run python3 -m pytest -q -m gpu tests/test_gpu.py

Dummy weights make a degenerate model (its greedy answer repeats a couple of tokens whatever the
image), so that an answer depends on the image is checked on CPU only (test_handoff_flow.py).
"""

from __future__ import annotations

import os

import msgspec
import pytest

from mmhandoff.decode.full_media import FullMediaDecodeWorker
from mmhandoff.decode.worker import DecodeWorker
from mmhandoff.engine.stream import KVCoverageError, collect
from mmhandoff.prefill.worker import PrefillWorker
from mmhandoff.wire.messages import PrefillRequest
from tests.conftest import chat, data_uri, encode, free_port, make_image, start
from tests.fault_connector import MARK
from tests.flows import (agg_run, assert_pooled_renders_alike, full_media_run, greedy,
                          handoff_run, published_chain, released_at_once)
from tests.test_handoff_flow import _wait_for, continued, whole_answer

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def gpu(loop):
    from mmhandoff.models.dummy import ensure_dummy_model
    from mmhandoff.vllm_adapter import EngineSpec
    from mmhandoff.vllm_adapter.kv_events import KVEventSubscriber

    # MMHANDOFF_GPU_KV_PER_LAYER=1: the same tests with vLLM's per-layer KV layout (one NIXL
    # descriptor per layer and K/V) instead of EngineSpec's default (one per block)
    # eager: these tests check the handoff's logic on a real-size shape; CUDA graphs and
    # compilation (the GPU default) are what test_gpu_served.py's graphs run
    common = dict(model=str(ensure_dummy_model("llava-1.5-7b")), dtype="bfloat16",
                  enforce_eager=True,
                  extra={"load_format": "dummy"}, gpu_memory_utilization=0.25,
                  kv_blocks_across_layers=os.environ.get("MMHANDOFF_GPU_KV_PER_LAYER") != "1")
    ports = {role: free_port() for role in ("prefill", "decode")}
    # decode's connector fails the loads of requests marked for it (tests/fault_connector.py)
    fault = {"decode": "tests.fault_connector.FaultInjectingNixlConnector"}
    # prefill processes images on several threads (without vLLM's processed-image cache): the
    # parity tests run through that path, the full-media decode through vLLM's default one
    engines = {role: start(loop, EngineSpec(
        role=role, nixl_port=free_port(), **common, connector_module=fault.get(role),
        renderer_workers="auto" if role == "prefill" else None,
        kv_events_endpoint=f"tcp://*:{ports[role]}" if role in ports else None))
        for role in ("prefill", "decode", "full_media_decode")}
    events = {role: KVEventSubscriber(f"tcp://127.0.0.1:{port}") for role, port in ports.items()}
    yield engines, events
    for sub in events.values():
        sub.close()
    for engine in engines.values():
        engine.shutdown()


@pytest.fixture(scope="module")
def workers(gpu):
    engines, _ = gpu
    return (PrefillWorker(engines["prefill"]),
            DecodeWorker(engines["decode"], kv_deadline_s=60),
            FullMediaDecodeWorker(engines["full_media_decode"], kv_deadline_s=60))


CASES = {
    "640x480": [(640, 480, "JPEG", 1)],
    "12mp": [(4000, 3000, "JPEG", 2)],
    "two-images": [(640, 480, "JPEG", 3), (800, 600, "PNG", 4)],
}


@pytest.mark.parametrize("case", list(CASES))
def test_parity_handoff_agg_full_media_on_a_gpu(loop, gpu, workers, case):
    engines, _ = gpu
    prefill, decode, full = workers
    assert not decode.engine.capabilities.vision and full.engine.capabilities.vision
    blobs = [encode(make_image(w, h, seed), fmt) for w, h, fmt, seed in CASES[case]]
    mimes = ["image/jpeg" if b[:2] == b"\xff\xd8" else "image/png" for b in blobs]
    messages = chat("Describe the pictures.", *(data_uri(b, m) for b, m in zip(blobs, mimes)))
    s = greedy(16, ignore_eos=True)
    tokens, last, handoff = loop.run(handoff_run(prefill, decode, f"gpu-{case}", messages, s),
                                     timeout=300)
    agg = loop.run(agg_run(prefill, engines["full_media_decode"], f"gpu-{case}", messages, s),
                   timeout=300)
    full_tokens, full_last = loop.run(
        full_media_run(prefill, full, f"gpu-{case}", messages, s, blobs), timeout=300)
    assert len(tokens) == 16 and tokens == agg == full_tokens
    assert len(handoff.features.mm_hashes["image"]) == len(blobs)
    assert last.stats.request_bytes < 4096 < sum(map(len, blobs))  # metadata, never the media
    # every prompt token's KV came from prefill or the engine's own cache, image positions
    # included, in both decode engines
    for stats in (last.stats, full_last.stats):
        assert stats.kv_tokens_pulled + stats.kv_tokens_local == len(handoff.token_ids), stats
    assert last.stats.kv_tokens_pulled > 0


def test_block_hashes_equal_on_prefill_and_decode_on_a_gpu(loop, gpu, workers):
    _, events = gpu
    prefill, decode, _ = workers
    uri = data_uri(encode(make_image(300, 200, 7)))
    _, _, h = loop.run(handoff_run(prefill, decode, "gpu-hash", chat("Hash me.", uri),
                                   greedy(4)))
    assert _wait_for(lambda: published_chain(events["prefill"], h.token_ids)
                     and published_chain(events["decode"], h.token_ids))
    assert published_chain(events["prefill"], h.token_ids) == \
        published_chain(events["decode"], h.token_ids)


def test_decode_fails_closed_without_kv_and_stays_healthy_on_a_gpu(loop, gpu, workers):
    engines, _ = gpu
    prefill, decode, _ = workers
    messages = chat("No KV?", data_uri(encode(make_image(640, 480, 9), "JPEG"), "image/jpeg"))
    s = greedy(8, ignore_eos=True)
    handoff, _ = loop.run(prefill.handoff(PrefillRequest(request_id="gpu-nokv",
                                                         messages=messages, sampling=s)))
    with pytest.raises(KVCoverageError):
        loop.run(collect(decode.generate(msgspec.structs.replace(handoff,
                                                                 kv_transfer_params={}))))
    tokens, _, _ = loop.run(handoff_run(prefill, decode, "gpu-after", messages, s))
    assert tokens == loop.run(agg_run(prefill, engines["full_media_decode"], "gpu-after",
                                      messages, s))


def test_an_injected_kv_load_failure_fails_closed_on_a_gpu(loop, gpu, workers):
    """NIXL reports the pulled blocks as failed (as for a transfer error): vLLM's failure path
    on the GPU ends the request with a typed error, and the engine answers the next one."""
    engines, _ = gpu
    prefill, decode, _ = workers
    messages = chat("Fail me.", data_uri(encode(make_image(640, 480, 11), "JPEG"), "image/jpeg"))
    s = greedy(8, ignore_eos=True)
    handoff, _ = loop.run(prefill.handoff(PrefillRequest(
        request_id=f"gpu-{MARK}", messages=messages, sampling=s)))
    with pytest.raises(KVCoverageError) as err:
        loop.run(collect(decode.generate(handoff)), timeout=120)
    assert "kv_load_failed" in err.value.cause
    tokens, _, _ = loop.run(handoff_run(prefill, decode, "gpu-after-fault", messages, s))
    assert tokens == loop.run(agg_run(prefill, engines["full_media_decode"], "gpu-after-fault",
                                      messages, s))


def test_an_answer_continued_from_its_first_tokens_on_a_gpu(loop, workers):
    """Migration's adapter paths (Engine.extend, the continued text) on the GPU's vLLM: an answer
    continued after its first k tokens equals the uninterrupted one, tokens and text."""
    prefill, decode, _ = workers
    messages = chat("Describe it.", data_uri(encode(make_image(640, 480, 7), "JPEG"),
                                             "image/jpeg"))
    whole = whole_answer(loop, prefill, decode, PrefillRequest(
        request_id="gpu-whole", messages=messages, sampling=greedy(16, ignore_eos=True)))
    for k in (1, 7):
        rest = continued(loop, prefill, decode, messages, whole, k)
        assert whole[k:] == rest or (  # the same tokens; text per chunk may group differently
            [t for t, _ in whole[k:]] == [t for t, _ in rest]
            and "".join(x for _, x in whole) == "".join(x for _, x in whole[:k] + rest)), k


def test_engines_batch_as_vllm_serve_does_on_a_gpu(gpu):
    """vLLM sizes the batch by usage context; an AsyncLLM started without one took the bare
    scheduler defaults (2048 tokens, 128 sequences), a quarter of `vllm serve`'s on an H100."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.usage.usage_lib import UsageContext

    engines, _ = gpu
    tokens, seqs = (table[UsageContext.OPENAI_API_SERVER]
                    for table in EngineArgs.get_batch_defaults(world_size=1))
    for engine in engines.values():
        config = engine.llm.vllm_config.scheduler_config
        assert (config.max_num_batched_tokens, config.max_num_seqs) == (tokens, seqs)


def test_images_are_processed_on_several_threads_on_a_gpu(loop, gpu):
    """Issue 37: an engine asked for several renderer threads has them (and vLLM then keeps no
    processed-image cache), and images rendered side by side come out as each does alone."""
    import asyncio

    import torch

    from mmhandoff.media.images import decode_image
    from mmhandoff.vllm_adapter.engine import AUTO_RENDERER_WORKERS

    engines, _ = gpu
    prefill = engines["prefill"]
    threads = min(AUTO_RENDERER_WORKERS, len(os.sched_getaffinity(0)))
    assert prefill.llm.model_config.renderer_num_workers == threads > 1
    assert prefill.llm.renderer.mm_processor_cache is None
    full = engines["full_media_decode"].llm  # the default: vLLM's one thread and its cache
    assert full.model_config.renderer_num_workers == 1
    assert full.renderer.mm_processor_cache is not None
    prompt = prefill.chat_prompt([{"role": "user", "content": [
        {"type": "image"}, {"type": "text", "text": "What is this?"}]}])
    images = [decode_image(encode(make_image(1600, 1200, 50 + i), "JPEG")) for i in range(8)]

    def seen(r):
        prefill.discard(r)
        pixels = [t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes()
                  for t in _pixel_tensors(r.engine_input)]
        assert pixels  # the processed image is in the render
        return r.token_ids, r.features, pixels

    alone = [seen(loop.run(prefill.render(prompt, [image]))) for image in images]

    async def together():
        return await asyncio.gather(*(prefill.render(prompt, [image]) for image in images))

    assert [seen(r) for r in loop.run(together())] == alone
    assert len({f.mm_hashes["image"][0] for _, f, _ in alone}) == len(images)


def test_images_from_the_media_pool_are_the_same_engine_input_on_a_gpu(loop, gpu):
    """Issue 37 on vLLM 0.26: the engine finds its presizer (the image processor its renderer
    calls, read through vLLM's processor), and a 12 MP photo presized in a media process is
    the same engine input as the photo itself (test_media_pool_engine.py on the CPU)."""
    engines, _ = gpu
    assert_pooled_renders_alike(loop, engines["prefill"], {
        case: chat("What is this?", *(
            data_uri(encode(make_image(w, h, 60 + seed), fmt), f"image/{fmt.lower()}")
            for w, h, fmt, seed in CASES[case]))
        for case in ("12mp", "two-images")}, media_workers=2)


def _pixel_tensors(engine_input) -> list:
    """The processed image tensors a render hands the engine core (vLLM's kwargs items)."""
    import torch

    found = []

    def walk(x):
        if isinstance(x, torch.Tensor):
            found.append(x)
        elif isinstance(x, dict):
            for v in x.values():
                walk(v)
        elif isinstance(x, (list, tuple)):
            for v in x:
                walk(v)
        elif hasattr(x, "__dict__"):
            walk(vars(x))

    walk(engine_input.get("mm_kwargs"))
    return found


def test_prefill_frees_an_unclaimed_handoffs_blocks_on_a_gpu(loop, workers):
    """Issue 35 on vLLM 0.26 and a GPU: as test_prefill_lease.py's test on the CPU."""
    released_at_once(loop, workers[0], "gpu-unclaimed")
