"""Prefill's bypass on real engines: a follow-up whose prefix decode already holds is answered by
decode from its own prefix cache (no prefill engine request, no KV pulled) as agg answers it; one
whose blocks decode does not hold fails closed; a render that is never submitted leaves vLLM's
processed-image cache as it was (the next request with the image still sends it); an image sent
again as the same data URI is rendered without its pixels, as its decode rendered it."""

from __future__ import annotations

import pytest

from mmhandoff.engine import PixelsNeeded
from mmhandoff.engine.stream import KVCoverageError, collect
from mmhandoff.media.images import decode_image
from mmhandoff.prefill.worker import PrefillWorker
from mmhandoff.vllm_adapter.inputs import forget_sent
from mmhandoff.wire.handoff import decode_handoff
from mmhandoff.wire.messages import ChatMessage, KvHeld, PrefillRequest
from tests.conftest import chat, data_uri, encode, make_image
from tests.flows import agg_run, greedy, handoff_run
from tests.test_handoff_flow import workers  # noqa: F401  (the engines' workers)

pytestmark = pytest.mark.engine

BLOCK = 32
# long enough that the image ends inside the first turn's full blocks
QUESTION = ("Look at this picture carefully and describe what you see in it, the colours, the "
            "shapes, and anything else that stands out, in a few short sentences please.")


class Claims:
    """router.held as a test double: decode instance 1 holds every full block of the prompt
    (true only if decode really served it: the engine decides, fail-closed)."""

    async def held(self, handoff):
        n = len(decode_handoff(handoff).token_ids) // BLOCK  # its bytes, as the router gets them
        return KvHeld(instance=1, blocks_held=n, blocks=n)


def _conversation(seed: int) -> tuple[list, list]:
    uri = data_uri(encode(make_image(96, 64, seed)))
    first = chat(QUESTION, uri)
    follow_up = [*first, ChatMessage("assistant", "A small picture."),
                 ChatMessage("user", "Tell me more.")]
    return first, follow_up


def _bypass(loop, prefill, request_id, messages, s):
    bypassing = PrefillWorker(prefill.engine, router=Claims(), bypass_max_tokens=256)
    answer = loop.run(bypassing.prefill(PrefillRequest(
        request_id=request_id, messages=messages, sampling=s)))
    handoff = decode_handoff(answer.handoff)
    assert answer.stats.bypassed and handoff.kv_transfer_params == {}
    return handoff


def test_a_follow_up_decode_holds_is_answered_from_its_cache_as_agg(loop, workers, engines):
    prefill, decode, _ = workers
    first, follow_up = _conversation(61)
    s = greedy(12, ignore_eos=True)
    loop.run(handoff_run(prefill, decode, "bp-1", first, s))  # decode now holds its blocks
    handoff = _bypass(loop, prefill, "bp-2", follow_up, s)
    images_end = max(sp.offset + sp.length for *_, sp in handoff.items())
    assert images_end <= len(handoff.token_ids) // BLOCK * BLOCK  # the test's premise
    tokens, last = loop.run(collect(decode.generate(handoff)))
    assert tokens == loop.run(agg_run(prefill, engines.full, "bp-agg", follow_up, s))
    assert last.stats.kv_tokens_pulled == 0 and last.stats.kv_tokens_local >= images_end


def test_a_bypass_decode_does_not_hold_fails_closed_and_decode_serves_on(loop, workers):
    prefill, decode, _ = workers
    _, follow_up = _conversation(62)  # its first turn never ran: nothing is cached
    s = greedy(8, ignore_eos=True)
    with pytest.raises(KVCoverageError):
        loop.run(collect(decode.generate(_bypass(loop, prefill, "bp-miss", follow_up, s))))
    tokens, _, _ = loop.run(handoff_run(prefill, decode, "bp-after", follow_up, s))
    assert len(tokens) == 8


def test_a_discarded_render_leaves_the_image_to_be_sent_again(loop, engines):
    """vLLM's frontend process mirrors the engine core's cache of processed images and sends a
    recorded image as its hash alone. A render never submitted must not leave it recorded: the
    core would miss it on the next request (an error with no token)."""
    engine = engines.prefill
    image = decode_image(encode(make_image(80, 60, 63)))
    prompt = engine.chat_prompt([{"role": "user", "content": [
        {"type": "image"}, {"type": "text", "text": "What is it?"}]}])
    cache = engine.llm.renderer.mm_processor_cache
    rendered = loop.run(engine.render(prompt, [image]))
    assert rendered.first_sent == (image.content_hash,)
    assert cache.is_cached_item(image.content_hash)  # recorded by rendering alone
    engine.discard(rendered)
    assert not cache.is_cached_item(image.content_hash)
    again = loop.run(engine.render(prompt, [image]))
    assert again.first_sent == (image.content_hash,)  # sent with its data this time

    async def run():
        out = []
        async for step in engine.generate(engine.request(again, greedy(2)), "bp-discard"):
            out.append(step)
        return out

    steps = loop.run(run())
    assert steps[-1].finish_reason == "length" and sum(len(s.token_ids) for s in steps) == 2
    seen = loop.run(engine.render(prompt, [image]))  # submitted: recorded, nothing to undo
    assert seen.first_sent == ()
    engine.discard(seen)
    assert cache.is_cached_item(image.content_hash)


def test_an_image_sent_again_renders_without_its_pixels_as_its_decode_did(loop, workers):
    """engine.prompt's memo on vLLM: a data URI prefill decoded before goes to the engine
    without pixels (vLLM's processor cache has the image) and renders the same token ids and
    features; once vLLM no longer records it, prefill decodes it again."""
    prefill, decode, _ = workers
    messages = chat("What is in this picture?", data_uri(encode(make_image(120, 80, 64))))
    s = greedy(4, ignore_eos=True)
    _, _, first = loop.run(handoff_run(prefill, decode, "memo-1", messages, s))
    request = PrefillRequest(request_id="memo", messages=messages, sampling=s)
    (bare,) = loop.run(prefill.prompts.media(request))
    assert bare.image is None and bare.content_hash == first.features.mm_hashes["image"][0]
    tokens, _, again = loop.run(handoff_run(prefill, decode, "memo-2", messages, s))
    assert (again.token_ids, again.features) == (first.token_ids, first.features)
    assert len(tokens) == 4
    forget_sent(prefill.engine.llm, (bare.content_hash,))  # as if vLLM had evicted it
    with pytest.raises(PixelsNeeded):
        loop.run(prefill.engine.render(prefill.prompts.text(request), [bare]))
    tokens, _, third = loop.run(handoff_run(prefill, decode, "memo-3", messages, s))
    assert (third.token_ids, third.features) == (first.token_ids, first.features)
    assert len(tokens) == 4
