"""On a GPU host only: the handoff with a real-size shape (LLaVA-1.5-7B layout, dummy weights),
prefill, decode and the agg reference sharing one GPU. The `gpu` tier: CI's CPU run does not
select it; on the lent H200 it runs through the wheel bundle (docs/gpu.md):

    scripts/gpu/device.sh run python3 -m pytest -q -m gpu tests/test_gpu.py
"""

from __future__ import annotations

import pytest

from mmhandoff.agg.worker import AggWorker
from mmhandoff.decode.stream import collect
from mmhandoff.decode.worker import DecodeWorker
from mmhandoff.prefill.worker import PrefillWorker
from tests.conftest import chat, data_uri, encode, free_port, make_image, start
from tests.flows import greedy, handoff_run

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def workers(loop):
    from mmhandoff.models.dummy import ensure_dummy_model
    from mmhandoff.vllm_adapter import EngineSpec

    common = dict(model=str(ensure_dummy_model("llava-1.5-7b")), dtype="bfloat16",
                  extra={"load_format": "dummy"}, gpu_memory_utilization=0.25)
    engines = [start(loop, EngineSpec(role=role, nixl_port=free_port(), **common))
               for role in ("prefill", "decode", "agg")]
    prefill, decode, agg = engines
    yield PrefillWorker(prefill), DecodeWorker(decode, kv_deadline_s=60), AggWorker(agg)
    for engine in engines:
        engine.shutdown()


def test_the_handoff_equals_agg_on_a_gpu_and_decode_has_no_vision_tower(loop, workers):
    from mmhandoff.wire.messages import PrefillRequest

    prefill, decode, agg = workers
    assert not decode.engine.capabilities.vision and agg.engine.capabilities.vision
    # Dummy weights make a degenerate model: its greedy answer repeats two tokens whatever the
    # image (seen on the H200), so that the answer depends on the image is checked on CPU only
    # (test_handoff_flow.py, the tiny model's trained-free but varied weights).
    for seed in (1, 2):
        messages = chat("Describe it.", data_uri(encode(make_image(640, 480, seed))))
        tokens, last, handoff = loop.run(handoff_run(prefill, decode, f"gpu-{seed}", messages,
                                                     greedy(16, ignore_eos=True)))
        reference, _ = loop.run(collect(agg.generate(PrefillRequest(
            request_id=f"gpu-agg-{seed}", messages=messages,
            sampling=greedy(16, ignore_eos=True)))))
        assert tokens == reference, seed
        # every prompt token's KV came from prefill (none from decode's own cache)
        assert last.stats.kv_tokens_pulled + last.stats.kv_tokens_local == len(handoff.token_ids)
        assert last.stats.kv_tokens_pulled > 576  # at least the image's 576 positions
