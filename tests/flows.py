"""The three ways a test runs one request (handoff, aggregated, full-media P/D), the block
hashes an engine published for a prompt, the prefill engine's KV usage, and a decode message's
handoff (opened, sealed again)."""

from __future__ import annotations

import time

import msgspec

from mmhandoff.decode.worker import collect
from mmhandoff.vllm_adapter.inputs import sampling_params
from mmhandoff.wire.handoff import Handoff, Sampling, decode_handoff, encode_handoff
from mmhandoff.wire.messages import (
    FullMediaRequest,
    HandoffMessage,
    PrefillRequest,
    handoff_bytes,
)


def opened(message: dict | str) -> Handoff:
    """The Handoff in decode's message (or in a prefill answer's `handoff` text)."""
    return decode_handoff(handoff_bytes(message if isinstance(message, dict)
                                        else {"handoff": message}))


def sealed(h: Handoff) -> dict:
    """Decode's message for `h`, as the frontend sends it (its bytes, base64 in JSON)."""
    return msgspec.to_builtins(HandoffMessage(encode_handoff(h)))


def greedy(max_tokens: int = 32, **kw) -> Sampling:
    return Sampling(max_tokens=max_tokens, temperature=0.0, **kw)


async def handoff_run(prefill, decode, request_id, messages, sampling, first_token=True):
    """The whole answer through the handoff: prefill's first token, then decode's (with
    `first_token` False, the older contract: decode's alone)."""
    handoff, _ = await prefill.handoff(PrefillRequest(
        request_id=request_id, messages=messages, sampling=sampling, first_token=first_token))
    tokens, last = await collect(decode.generate(handoff))
    first = [handoff.first_token] if handoff.first_token is not None else []
    return [*first, *tokens], last, handoff


async def agg_run(prefill, full_engine, request_id, messages, sampling):
    """The whole request on one engine, no KV transfer, straight through vLLM: the reference."""
    request = PrefillRequest(request_id=request_id, messages=messages, sampling=sampling)
    item = {"prompt": prefill.prompts.text(request)}
    media = await prefill.prompts.media(request, decode=True)  # pixels, for vLLM itself
    for i in media:  # (a video: frames as vLLM's own loader sampled them)
        item.setdefault("multi_modal_data", {}).setdefault(i.modality, []).append(i.data)
    final = None
    async for out in full_engine.llm.generate(item, sampling_params(sampling), f"{request_id}:agg"):
        final = out
    return list(final.outputs[0].token_ids)


async def full_media_run(prefill, full_worker, request_id, messages, sampling, image_bytes):
    """P/D where decode receives the media again and re-processes it."""
    handoff, _ = await prefill.handoff(
        PrefillRequest(request_id=request_id, messages=messages, sampling=sampling))
    prompt = prefill.prompts.text(
        PrefillRequest(request_id=request_id, messages=messages, sampling=sampling))
    wire = msgspec.msgpack.encode(FullMediaRequest(
        request_id=request_id, prompt=prompt, images=image_bytes,
        kv_transfer_params=handoff.kv_transfer_params, sampling=sampling))
    tokens, last = await collect(full_worker.generate(wire))
    return tokens, last


def published_chain(events, token_ids, block_size=32):
    """The hashes an engine's KV events (a KVEventSubscriber) stored for the full blocks of
    `token_ids`, followed parent to child from the first block; None until every block has
    been seen."""
    found, parent = [], None
    for i in range(len(token_ids) // block_size):
        block = tuple(token_ids[i * block_size:(i + 1) * block_size])
        match = [b for b in events.stored() if b.token_ids == block and b.parent == parent]
        if not match:
            return None
        parent = match[-1].block_hash
        found.append(parent)
    return found



def prefill_kv_usage(loop, engine, load, tag):
    """Run one tiny text request so the engine steps (and frees what it may); its KV usage."""
    from vllm import SamplingParams

    async def poke():
        async for _ in engine.llm.generate({"prompt": "hi"}, SamplingParams(max_tokens=1), tag):
            pass

    loop.run(poke())
    return load.kv_cache_usage


def wait_for_prefill_kv(loop, engines, predicate, timeout):
    """Whether the prefill engine's KV usage meets `predicate` within `timeout` seconds."""
    deadline = time.monotonic() + timeout
    i = 0
    while time.monotonic() < deadline:
        i += 1
        if predicate(prefill_kv_usage(loop, engines.prefill, engines.prefill_load, f"poke-{i}")):
            return True
        time.sleep(0.25)
    return False


def released_at_once(loop, prefill, request_id: str) -> None:
    """Prefill's engine takes the release of a handoff nobody claimed (core.release, through the
    worker extension and collective_rpc): its connector held the request's blocks for a
    consumer, ends that lease at once, and its next poll frees them (the lease book no longer
    names the request). The prefill worker releases unclaimed handoffs this way after
    --release-unclaimed-s."""
    import asyncio

    from mmhandoff.wire.messages import PrefillRequest
    from tests.conftest import chat, data_uri, encode, make_image

    handoff, _ = loop.run(prefill.handoff(PrefillRequest(
        request_id=request_id, sampling=greedy(4, ignore_eos=True),
        messages=chat("Nobody claims me.", data_uri(encode(make_image(320, 240, 11)))))))
    held = [handoff.kv_transfer_params]

    async def release_until(expected: int, within_s: float) -> None:
        t0 = time.monotonic()
        while (got := await prefill.engine.release_kv(held)) != expected:
            assert time.monotonic() - t0 < within_s, got
            await asyncio.sleep(0.05)

    # the model worker learns of the held blocks at the engine's next step, then ends the lease
    loop.run(release_until(1, 10))
    loop.run(release_until(0, 5))  # reaped: the blocks are free, the lease book is empty of it


def rendered_input(loop, prompts, request_id: str, messages) -> tuple:
    """What `prompts` (a PromptBuilder on a vLLM engine) has the engine compute for `messages`:
    the token ids, each item's identity and span, and each item's processed tensors. The render
    is then discarded, so the next render of the same images processes them again."""
    request = PrefillRequest(request_id=request_id, messages=messages, sampling=greedy(1))
    media = loop.run(prompts.media(request))
    rendered = loop.run(prompts.render(request, media))
    prompts.engine.discard(rendered)
    processed = [None if item is None else item.get_data()
                 for items in rendered.engine_input["mm_kwargs"].values() for item in items]
    return rendered.token_ids, rendered.features, processed


def assert_same_tensors(a: list, b: list) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x is not None and y is not None  # processed here, not taken from a cache
        assert x.keys() == y.keys()
        for k in x:
            assert x[k].shape == y[k].shape and bool((x[k] == y[k]).all()), k


def assert_pooled_renders_alike(loop, engine, questions: dict[str, list],
                                media_workers: int = 1) -> None:
    """Each question's images prepared in media processes (media.pool, presized with the
    presizer `engine` checked) render as the same engine input as in the worker's threads. The
    images must be ones no earlier test sent `engine` (its processed-image cache would send
    them by hash alone)."""
    from mmhandoff.engine.prompt import PromptBuilder
    from mmhandoff.media.pool import MediaPool

    assert engine.presizer() is not None
    pooled = PromptBuilder(engine, pool=MediaPool(media_workers))
    threads = PromptBuilder(engine)
    pooled.start()
    try:
        for name, messages in questions.items():
            ids_a, features_a, tensors_a = rendered_input(loop, pooled, f"pool-{name}", messages)
            ids_b, features_b, tensors_b = rendered_input(loop, threads, f"threads-{name}",
                                                          messages)
            assert ids_a == ids_b
            assert_identities(features_a, features_b, messages, engine.presizer())
            assert_same_tensors(tensors_a, tensors_b)
    finally:
        pooled.close()


def pooled_identity(presizer, data: bytes, draft=None) -> str:
    """An image's identity as a media process gives it, computed here apart: the hash of its
    presized pixels (their own domain) where presizing makes it smaller, else of the whole
    image's, as in the worker's threads (media.images)."""
    from mmhandoff.media.images import PRESIZED_DOMAIN, content_hash, decode_rgb

    image = decode_rgb(data, draft=draft)
    small = presizer(image)
    return content_hash(image) if small is image else content_hash(small, PRESIZED_DOMAIN)


def message_images(messages) -> list[bytes]:
    """The bytes of every data-URI image in `messages`, in order."""
    import base64

    return [base64.b64decode(part.image_url.url.split(",", 1)[1]) for m in messages
            for part in (m.content if isinstance(m.content, list) else [])
            if getattr(part, "image_url", None) is not None]


def assert_identities(pooled, threads, messages, presizer, draft=None) -> None:
    """The features of one prompt rendered with media processes (`pooled`) and in the worker's
    threads: the same spans; each path's identities as media.images defines them."""
    from mmhandoff.media.images import decode_image

    images = message_images(messages)
    assert pooled.mm_placeholders == threads.mm_placeholders
    assert pooled.mm_hashes == {"image": [pooled_identity(presizer, d, draft) for d in images]}
    assert threads.mm_hashes == {"image": [decode_image(d, draft=draft).content_hash
                                           for d in images]}
