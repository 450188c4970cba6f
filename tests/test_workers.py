"""The workers' logic around an engine, on FakeEngine (mmhandoff.engine.fake), in seconds: what
prefill, decode, agg and the full-media arm do, and the frontend in front of them over an
in-process plane. The same paths run on vLLM in the engine tier (test_handoff_flow.py,
test_fail_closed.py, test_frontend.py)."""

from __future__ import annotations

import itertools
import json
from contextlib import aclosing
import urllib.error
import urllib.request

import msgspec
import pytest

from mmhandoff.agg.worker import AggWorker
from mmhandoff.decode.full_media import FullMediaDecodeWorker
from mmhandoff.decode.worker import ERRORS as DECODE_ERRORS
from mmhandoff.decode.worker import DecodeWorker, UnsupportedModel
from mmhandoff.engine import EngineInputError
from mmhandoff.engine.fake import FakeEngine, FakeKV
from mmhandoff.engine.stream import KVCoverageError, collect
from mmhandoff.frontend.app import Frontend
from mmhandoff.plane.runtime import endpoint_handler
from mmhandoff.prefill.worker import ERRORS as PREFILL_ERRORS
from mmhandoff.prefill.full_media import FullMediaPrefillWorker
from mmhandoff.prefill.worker import PrefillWorker
from mmhandoff.wire.handoff import (
    DigestMismatch,
    FingerprintMismatch,
    Replayed,
    Unsigned,
    encode_handoff,
)
from mmhandoff.wire.messages import PrefillAnswer, PrefillRequest, user
from tests.conftest import data_uri, encode, make_image, serve_app
from tests.flows import greedy
from tests.local_plane import LocalClient

pytestmark = pytest.mark.unit

MODEL = "tiny-llava"
PNGS = [encode(make_image(64, 48, seed)) for seed in (1, 2)]
IMAGES = [data_uri(png) for png in PNGS]
_ids = itertools.count()


def ask(text: str, *uris: str, max_tokens: int = 6) -> PrefillRequest:
    return PrefillRequest(request_id=f"w-{next(_ids)}", messages=[user(text, *uris)],
                          sampling=greedy(max_tokens))


def tiers(kv: FakeKV | None = None, **decode_kw) -> tuple[PrefillWorker, DecodeWorker]:
    kv = kv or FakeKV()
    return (PrefillWorker(FakeEngine(role="prefill", kv=kv)),
            DecodeWorker(FakeEngine(role="decode", kv=kv, **decode_kw)))


def run(loop, coro, timeout=30):
    return loop.run(coro, timeout=timeout)


async def handoff_answer(prefill, decode, request):
    """The whole answer: prefill's first token, then decode's."""
    handoff, _ = await prefill.handoff(request)
    tokens, last = await collect(decode.generate(encode_handoff(handoff)))
    return [handoff.first_token, *tokens], last


def test_the_handoff_answer_equals_agg_and_depends_on_the_image(loop):
    prefill, decode = tiers()
    agg = AggWorker(FakeEngine())
    answers = {}
    for n, uri in enumerate(IMAGES):
        request = ask("What is it?", uri)
        tokens, last = run(loop, handoff_answer(prefill, decode, request))
        reference, agg_last = run(loop, collect(agg.generate(request)))
        assert tokens == reference and len(tokens) == 6
        assert last.stats.kv_tokens_pulled == last.stats.prompt_tokens > 0
        # where the time went: loading the image is part of the preparation, before the token
        assert 0 < agg_last.stats.media_ms <= agg_last.stats.prepare_ms <= agg_last.stats.ttft_ms
        assert last.stats.media_ms == -1  # decode loads no media
        answers[n] = tokens
    assert answers[0] != answers[1]
    assert not decode.engine.running and not prefill.engine.kv.blocks  # pulled, nothing held


def test_the_full_media_arm_equals_the_handoff_and_gets_the_media(loop):
    kv = FakeKV()
    prefill, decode = tiers(kv)
    arm = FullMediaDecodeWorker(FakeEngine(role="full_media_decode", kv=kv))
    request = ask("Full media?", IMAGES[0])

    async def full_media():
        answer = [a async for a in FullMediaPrefillWorker(prefill.engine).handle(
            msgspec.to_builtins(request))]
        typed = msgspec.convert(answer[0], PrefillAnswer)
        assert typed.handoff is None and typed.full_media.images == [PNGS[0]]
        return [c async for c in arm.handle(typed.for_decode())]

    chunks = run(loop, full_media())
    assert [t for c in chunks for t in c["token_ids"]] == run(
        loop, handoff_answer(prefill, decode, request))[0]
    assert chunks[-1]["stats"]["request_bytes"] > len(PNGS[0])


def test_decode_fails_closed_when_the_kv_is_gone(loop):
    prefill, decode = tiers()
    handoff, _ = run(loop, prefill.handoff(ask("Gone?", IMAGES[0])))
    prefill.engine.kv.blocks.clear()  # the lease ended, or prefill restarted
    with pytest.raises(KVCoverageError) as e:
        run(loop, collect(decode.generate(handoff)))
    assert e.value.cause.startswith("kv_load_failed") and e.value.fault == "server"
    assert not decode.engine.running


def test_the_kv_deadline_ends_a_pull_that_takes_too_long_and_frees_the_request(loop):
    prefill, decode = tiers(pull_s=30)
    decode.kv_deadline_s = 0.05
    handoff, _ = run(loop, prefill.handoff(ask("Slow?", IMAGES[0])))
    with pytest.raises(KVCoverageError, match="kv_deadline"):
        run(loop, collect(decode.generate(handoff)))
    assert not decode.engine.running


def test_a_caller_that_stops_reading_aborts_the_engine_request(loop):
    prefill, decode = tiers(step_s=0.01)
    handoff, _ = run(loop, prefill.handoff(ask("Long?", IMAGES[0], max_tokens=500)))

    async def first_then_leave():
        stream = decode.generate(handoff)
        first = await anext(stream)
        await stream.aclose()
        return first

    assert run(loop, first_then_leave()).token_ids
    assert not decode.engine.running and len(decode.engine.aborted) == 1


def test_decode_refuses_what_a_kv_only_decode_cannot_serve_and_agg_does_not_inherit_it(loop):
    with pytest.raises(UnsupportedModel, match="M-RoPE"):
        DecodeWorker(FakeEngine(role="decode", mrope=True))
    tokens, _ = run(loop, collect(AggWorker(FakeEngine(mrope=True)).generate(
        ask("Agg?", IMAGES[0]))))
    assert len(tokens) == 6


def test_a_handoff_for_another_model_is_refused_before_the_engine(loop):
    kv = FakeKV()
    prefill = PrefillWorker(FakeEngine(role="prefill", kv=kv))
    decode = DecodeWorker(FakeEngine(role="decode", kv=kv, model="another"))
    handoff, _ = run(loop, prefill.handoff(ask("Which model?", IMAGES[0])))
    with pytest.raises(FingerprintMismatch):
        run(loop, collect(decode.generate(handoff)))
    assert not decode.engine.running and kv.blocks  # nothing was pulled


def test_what_the_engine_refuses_is_the_clients_fault_on_both_tiers(loop):
    kv = FakeKV()
    long_prompt = "word " * 40
    short = PrefillWorker(FakeEngine(role="prefill", kv=kv, max_model_len=32))
    envelope = endpoint_handler(short.handle, PREFILL_ERRORS)

    async def refused():
        return [item async for item in envelope(msgspec.to_builtins(ask(long_prompt)))]

    (item,) = run(loop, refused())
    assert item["error"]["code"] == "invalid_request" and item["error"]["fault"] == "client"
    # a prefill with room for it, a decode without
    prefill = PrefillWorker(FakeEngine(role="prefill", kv=kv))
    decode = DecodeWorker(FakeEngine(role="decode", kv=kv, max_model_len=32))
    handoff, _ = run(loop, prefill.handoff(ask(long_prompt)))
    with pytest.raises(EngineInputError, match="longer than the model"):
        run(loop, collect(decode.generate(handoff)))
    assert not decode.engine.running


def test_the_network_endpoint_takes_data_uris_only(loop, tmp_path):
    path = tmp_path / "x.png"
    path.write_bytes(PNGS[0])
    prefill, _ = tiers()
    envelope = endpoint_handler(prefill.handle, PREFILL_ERRORS)

    async def answer():
        return [i async for i in envelope(msgspec.to_builtins(ask("File?", str(path))))]

    (item,) = run(loop, answer())
    assert item["error"]["code"] == "invalid_request"
    # in-process, a local file is an image like any other
    handoff, stats = run(loop, prefill.handoff(ask("File?", str(path))))
    assert stats.images == 1 and handoff.features.mm_hashes["image"]


# ---- the frontend in front of the workers -------------------------------------------------------
def _post(url: str, body: dict):
    req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            raw = r.read()
            return r.status, raw
    except urllib.error.HTTPError as e:
        return e.code, e.read()


@pytest.fixture
def graph(loop):
    """Frontend -> prefill -> decode on fake engines; yields (url, prefill, decode clients)."""
    kv = FakeKV()
    prefill, decode = tiers(kv)
    p = LocalClient(prefill.handle, PREFILL_ERRORS)
    d = LocalClient(decode.handle, DECODE_ERRORS)
    runner = Frontend(p, d, MODEL).runner()
    url = serve_app(loop, runner)
    yield url, prefill, decode, p, d
    loop.run(runner.cleanup())


def _chat_body(stream: bool, uri: str, max_tokens: int = 5) -> dict:
    return {"model": MODEL, "max_tokens": max_tokens, "temperature": 0, "stream": stream,
            "messages": [{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": uri}},
                {"type": "text", "text": "What is it?"}]}]}


def test_the_frontend_answers_as_agg_streaming_and_not(loop, graph):
    url, prefill, decode, _, _ = graph
    reference = run(loop, collect(AggWorker(FakeEngine()).generate(
        PrefillRequest(request_id="ref", messages=[user("What is it?", IMAGES[1])],
                       sampling=greedy(5)))))[0]
    expected = "".join(f" w{t}" for t in reference)
    status, raw = _post(url + "/v1/chat/completions", _chat_body(False, IMAGES[1]))
    assert status == 200, raw
    plain = json.loads(raw)
    assert plain["choices"][0]["message"]["content"] == expected
    assert plain["usage"]["completion_tokens"] == 5
    assert plain["mmhandoff"]["kv_tokens_pulled"] == plain["usage"]["prompt_tokens"] > 0
    status, raw = _post(url + "/v1/chat/completions", _chat_body(True, IMAGES[1]))
    events = [json.loads(line[6:]) for line in raw.decode().splitlines()
              if line.startswith("data: {")]
    assert status == 200 and "".join(
        e["choices"][0]["delta"].get("content") or "" for e in events if e["choices"]) == expected
    assert not prefill.engine.kv.blocks and not decode.engine.running


def test_the_frontend_retries_through_prefill_when_decode_fails_closed(loop, graph):
    url, prefill, decode, p, d = graph
    real_generate = prefill.engine.generate
    calls = 0

    async def first_kv_lost(request, request_id):
        nonlocal calls
        calls += 1
        async for step in real_generate(request, request_id):
            if calls == 1 and step.kv_transfer_params:
                prefill.engine.kv.blocks.pop(step.kv_transfer_params["fake_kv"])
            yield step

    prefill.engine.generate = first_kv_lost
    status, raw = _post(url + "/v1/chat/completions", _chat_body(False, IMAGES[0]))
    assert status == 200, raw
    assert json.loads(raw)["mmhandoff"]["retries"] == 1
    assert (p.requests, d.requests) == (2, 2)
    # prefill's first token had gone out: the retry continued from it, so the client got each
    # token once, the answer agg gives
    reference = _agg_text(loop, IMAGES[0], 5)
    assert json.loads(raw)["choices"][0]["message"]["content"] == reference
    assert not prefill.engine.kv.blocks and not decode.engine.running


def _agg_text(loop, uri: str, max_tokens: int) -> str:
    return "".join(f" w{t}" for t in _agg_tokens(loop, uri, max_tokens))


def _agg_tokens(loop, uri: str, max_tokens: int) -> list[int]:
    return run(loop, collect(AggWorker(FakeEngine()).generate(PrefillRequest(
        request_id="ref", messages=[user("What is it?", uri)], sampling=greedy(max_tokens)))))[0]


@pytest.mark.parametrize("stream", [False, True])
def test_the_first_token_comes_from_prefill_before_decode_admits(loop, graph, stream):
    url, prefill, decode, p, d = graph
    status, raw = _post(url + "/v1/chat/completions", _chat_body(stream, IMAGES[1]))
    assert status == 200, raw
    if stream:
        events = [json.loads(line[6:]) for line in raw.decode().splitlines()
                  if line.startswith("data: {")]
        text = "".join(e["choices"][0]["delta"].get("content") or "" for e in events)
        (stats,) = [e["mmhandoff"] for e in events if "mmhandoff" in e]
    else:
        text, stats = json.loads(raw)["choices"][0]["message"]["content"], \
            json.loads(raw)["mmhandoff"]
    assert text == _agg_text(loop, IMAGES[1], 5)
    # the frontend had delivered prefill's token before it asked decode for the rest
    assert 0 < stats["first_token_at"] < stats["admitted_at"]
    assert (p.requests, d.requests) == (1, 1)


@pytest.mark.parametrize("how", ["max_tokens 1", "stop token"])
def test_an_answer_ending_at_its_first_token_never_reaches_decode(loop, graph, how):
    url, prefill, decode, p, d = graph
    first = _agg_tokens(loop, IMAGES[0], 1)[0]
    body = (_chat_body(False, IMAGES[0], max_tokens=1) if how == "max_tokens 1" else
            {**_chat_body(False, IMAGES[0]), "stop_token_ids": [first]})
    status, raw = _post(url + "/v1/chat/completions", body)
    assert status == 200, raw
    got = json.loads(raw)
    finish = "length" if how == "max_tokens 1" else "stop"
    assert got["choices"][0]["finish_reason"] == finish
    assert got["choices"][0]["message"]["content"] == ("" if finish == "stop" else f" w{first}")
    assert got["usage"]["completion_tokens"] == 1 and got["usage"]["prompt_tokens"] > 0
    assert d.requests == 0 and got["mmhandoff"]["admitted_at"] == 0
    assert not prefill.engine.kv.blocks  # nothing held for a decode that will not come


def test_the_older_contract_lets_decode_sample_the_first_token(loop):
    kv = FakeKV()
    prefill, decode = tiers(kv)
    p = LocalClient(prefill.handle, PREFILL_ERRORS)
    d = LocalClient(decode.handle, DECODE_ERRORS)
    runner = Frontend(p, d, MODEL, first_token_from="decode").runner()
    url = serve_app(loop, runner)
    try:
        status, raw = _post(url + "/v1/chat/completions", _chat_body(False, IMAGES[1]))
        assert status == 200, raw
        got = json.loads(raw)
        assert got["choices"][0]["message"]["content"] == _agg_text(loop, IMAGES[1], 5)
        assert got["mmhandoff"]["first_token_at"] > got["mmhandoff"]["admitted_at"] > 0
        assert got["usage"]["prompt_tokens"] == got["mmhandoff"]["kv_tokens_pulled"]
    finally:
        loop.run(runner.cleanup())


def test_a_prompt_the_engine_refuses_is_a_400_and_nothing_is_left_running(loop, graph):
    url, prefill, decode, _, d = graph
    prefill.engine.max_model_len = 16
    status, raw = _post(url + "/v1/completions",
                        {"model": MODEL, "prompt": "word " * 40, "max_tokens": 3})
    assert status == 400 and json.loads(raw)["error"]["code"] == "invalid_request"
    assert d.requests == 0 and not prefill.engine.running


def test_signed_handoffs_are_taken_once_and_only_with_a_key_decode_has(loop):
    kv = FakeKV()
    prefill = PrefillWorker(FakeEngine(role="prefill", kv=kv), key=b"k" * 32)
    handoff, _ = run(loop, prefill.handoff(ask("Signed?", IMAGES[0])))
    assert handoff.digest and handoff.nonce and handoff.expires_at
    for keys, error in (([b"x" * 32], DigestMismatch), ((), DigestMismatch)):
        decode = DecodeWorker(FakeEngine(role="decode", kv=kv), keys=keys)
        with pytest.raises(error):  # another key; or a decode that takes a checksum only
            run(loop, collect(decode.generate(handoff)))
    decode = DecodeWorker(FakeEngine(role="decode", kv=kv), keys=[b"x" * 32, b"k" * 32])
    assert len(run(loop, collect(decode.generate(handoff)))[0]) == 5  # after prefill's first
    with pytest.raises(Replayed):  # the same handoff again
        run(loop, collect(decode.generate(handoff)))
    unsigned, _ = run(loop, PrefillWorker(FakeEngine(role="prefill", kv=kv)).handoff(
        ask("Unsigned?", IMAGES[1])))
    with pytest.raises(Unsigned):
        run(loop, collect(decode.generate(unsigned)))
    assert not decode.engine.running


@pytest.mark.parametrize("keys", [(), (b"k" * 32,)])
def test_decode_warms_up_through_its_whole_path(loop, keys):
    """Before it reports ready (process.engine_worker): one short answer through admission (signed
    when decode takes signed handoffs only), the continuation after a first token, the engine;
    nothing is left running and the worker then serves as usual."""
    kv = FakeKV()
    decode = DecodeWorker(FakeEngine(role="decode", kv=kv), keys=keys)
    steps = []
    real_generate = decode.engine.generate

    async def recorded(request, request_id):
        async with aclosing(real_generate(request, request_id)) as real:
            async for step in real:
                steps.append(step)
                yield step

    decode.engine.generate = recorded
    run(loop, decode.warm_up())
    assert [s.finish_reason for s in steps] == [None, "length"]  # 3 tokens, the first given
    assert not decode.engine.running and len(decode.replays) == len(keys)
    prefill = PrefillWorker(FakeEngine(role="prefill", kv=kv), key=keys[0] if keys else None)
    handoff, _ = run(loop, prefill.handoff(ask("After warm-up?", IMAGES[0])))
    assert len(run(loop, collect(decode.generate(handoff)))[0]) == 5


def test_prefills_statistics_count_images_and_videos_apart():
    from mmhandoff.media.images import LoadedImage
    from mmhandoff.media.videos import LoadedVideo
    from mmhandoff.prefill.worker import media_counts

    media = [LoadedImage(None, "a", 100), LoadedVideo(None, "v", 5000), LoadedImage(None, "b", 7)]
    assert media_counts(media) == {"images": 2, "image_bytes": 107, "videos": 1,
                                   "video_bytes": 5000}
    assert media_counts([]) == {"images": 0, "image_bytes": 0, "videos": 0, "video_bytes": 0}
