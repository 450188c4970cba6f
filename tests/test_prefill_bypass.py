"""Prefill's bypass (prefill.bypass) without engines: when the router says a decode replica
holds the prompt's blocks through its last image, prefill answers with a handoff that names no
KV and its engine never sees the request; otherwise it prefills as always."""

from __future__ import annotations

import asyncio

import pytest

from mmhandoff.engine.fake import FakeEngine
from mmhandoff.prefill.bypass import decode_can_answer
from mmhandoff.prefill.worker import PrefillWorker
from mmhandoff.wire.handoff import Sampling, check_admission, decode_handoff
from mmhandoff.wire.messages import KvHeld, PrefillRequest, user
from tests.conftest import data_uri, encode, make_image

pytestmark = pytest.mark.unit

KEY = b"k" * 32


class CountingEngine(FakeEngine):
    def __init__(self) -> None:
        super().__init__(role="prefill")
        self.submitted = 0

    def generate(self, request, request_id):
        self.submitted += 1
        return super().generate(request, request_id)


class Router:
    """router.held as a test double: answers `held`, or raises `error`."""

    def __init__(self, held: KvHeld | None = None, error: Exception | None = None) -> None:
        self.answer, self.error, self.asked = held, error, 0

    async def held(self, handoff):
        self.asked += 1
        if self.error is not None:
            raise self.error
        return self.answer


def _request(text: str = "What is it?", **kw) -> PrefillRequest:
    uri = data_uri(encode(make_image(32, 24, 3)))
    return PrefillRequest(request_id="r", messages=[user(text, uri)],
                          sampling=Sampling(max_tokens=4, temperature=0), **kw)


def _prefill(router, request=None, max_tokens=16):
    engine = CountingEngine()
    worker = PrefillWorker(engine, key=KEY, router=router, bypass_max_tokens=max_tokens)
    answer = asyncio.run(worker.prefill(request or _request()))
    return answer, engine


def test_a_prompt_decode_holds_through_its_image_skips_the_engine():
    # the fake engine's prompt: "<|user|>", 4 image tokens at 1..4, 4 words: 9 tokens in blocks
    # of 4, so 2 full blocks hold the image
    answer, engine = _prefill(Router(KvHeld(instance=7, blocks_held=2, blocks=2)))
    h = decode_handoff(answer.handoff)
    assert answer.stats.bypassed and answer.first is None and answer.stats.prefill_ms == 0
    assert h.kv_transfer_params == {} and h.first_token is None and h.requires_kv
    assert engine.submitted == 0 and len(engine.discarded) == 1  # rendered, never submitted
    check_admission(h, fingerprint=engine.fingerprint, keys=[KEY])  # signed as prefill signs


@pytest.mark.parametrize("case, router, request_kw, max_tokens", [
    ("the image is not all held", Router(KvHeld(instance=7, blocks_held=1, blocks=2)), {}, 16),
    ("no replica holds any", Router(KvHeld(blocks=2)), {}, 16),
    ("too much left to compute", Router(KvHeld(instance=7, blocks_held=2, blocks=4)),
     {"text": "What is it in this picture please?"}, 2),
    ("the router is away", Router(error=TimeoutError()), {}, 16),
    ("a retry after a failed bypass", Router(KvHeld(instance=7, blocks_held=2, blocks=2)),
     {"allow_bypass": False}, 16),
    ("a continued answer", Router(KvHeld(instance=7, blocks_held=2, blocks=2)),
     {"continuation": [5]}, 16),
    ("bypass off", Router(KvHeld(instance=7, blocks_held=2, blocks=2)), {}, 0),
])
def test_otherwise_prefill_runs_its_engine(case, router, request_kw, max_tokens):
    answer, engine = _prefill(router, _request(**request_kw), max_tokens)
    assert not answer.stats.bypassed and engine.submitted == 1 and not engine.discarded, case
    assert 0 < answer.stats.media_ms <= answer.stats.prepare_ms, case  # the image, then render
    assert decode_handoff(answer.handoff).kv_transfer_params  # names the KV decode pulls


def test_decode_can_answer_needs_every_image_position_held_and_little_left():
    answer, _ = _prefill(Router(KvHeld(instance=7, blocks_held=2, blocks=2)))
    h = decode_handoff(answer.handoff)  # 9 tokens, the image at [1, 5)
    assert decode_can_answer(h, KvHeld(instance=1, blocks_held=2), 4, 1)
    assert not decode_can_answer(h, KvHeld(instance=1, blocks_held=2), 4, 0)  # 1 token left
    assert not decode_can_answer(h, KvHeld(instance=1, blocks_held=1), 4, 16)  # image ends at 5
    assert not decode_can_answer(h, KvHeld(instance=None, blocks_held=2), 4, 16)
