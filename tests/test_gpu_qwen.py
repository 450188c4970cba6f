"""On a GPU host only: Qwen2.5-VL-7B's shape (dummy weights) on the media-free path, images and
a short video: prefill, decode (no vision tower) and the aggregated reference sharing one GPU.
The `gpu` tier, like tests/test_gpu.py (its own module, so that its three engines and
test_gpu.py's never hold the GPU together):

    scripts/gpu/device.sh run python3 -m pytest -q -m gpu tests/test_gpu_qwen.py

Dummy weights make a degenerate model, so these check the mechanics on a real shape (vLLM's
M-RoPE positions from the carried grids and seconds, CUDA kernels, the pull), not that an
answer depends on the media (tests/test_qwen2_vl.py does, on the CPU)."""

from __future__ import annotations

import pytest

from mmhandoff.decode.worker import DecodeWorker
from mmhandoff.prefill.worker import PrefillWorker
from tests.conftest import encode, free_port, make_image, make_video, start, video_chat
from tests.flows import agg_run, greedy, handoff_run

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def qwen_gpu(loop):
    from mmhandoff.models.dummy import ensure_dummy_model
    from mmhandoff.vllm_adapter import EngineSpec

    common = dict(model=str(ensure_dummy_model("qwen2.5-vl-7b")), dtype="bfloat16",
                  enforce_eager=True, max_model_len=16384, extra={"load_format": "dummy"},
                  gpu_memory_utilization=0.28)
    engines = {role: start(loop, EngineSpec(role=role, nixl_port=free_port(), **common))
               for role in ("prefill", "decode", "full_media_decode")}
    yield engines
    for engine in engines.values():
        engine.shutdown()


CASES = {
    "640x480 jpeg": [("image", encode(make_image(640, 480, 81), "JPEG"))],
    "4 s video": [("video", make_video(640, 360, 32, 8.0, 82))],
    "an image then a video": [("image", encode(make_image(800, 600, 83), "JPEG")),
                              ("video", make_video(320, 240, 24, 12.0, 84))],
}


@pytest.mark.parametrize("case", list(CASES))
def test_qwen2_5_vl_parity_handoff_agg_on_a_gpu(loop, qwen_gpu, case):
    prefill = PrefillWorker(qwen_gpu["prefill"])
    decode = DecodeWorker(qwen_gpu["decode"], kv_deadline_s=60)
    assert not decode.engine.capabilities.vision
    parts = CASES[case]
    messages = video_chat("Describe it.", *parts)
    s = greedy(16, ignore_eos=True)
    tokens, last, handoff = loop.run(handoff_run(prefill, decode, f"gq-{case}", messages, s),
                                     timeout=300)
    agg = loop.run(agg_run(prefill, qwen_gpu["full_media_decode"], f"gq-{case}", messages, s),
                   timeout=300)
    assert len(tokens) == 16 and tokens == agg
    assert last.stats.kv_tokens_pulled + last.stats.kv_tokens_local == len(handoff.token_ids)
    for kind, _ in parts:
        (grid,) = handoff.features.mm_grids[kind]
        assert (grid.seconds is not None) == (kind == "video")
    # metadata only: token ids and a few numbers per item, never the media
    assert last.stats.request_bytes < 8 * len(handoff.token_ids) + 4096
    assert last.stats.request_bytes < sum(len(blob) for _, blob in parts)
