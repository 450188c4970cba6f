"""The OpenAI-compatible frontend over the Dynamo endpoints, driven by the official openai client:
answers equal the in-process path, bad input gets the documented 4xx, image URLs go through the
fetch guard, /metrics counts, and a client that leaves mid-answer leaves nothing running."""

from __future__ import annotations

import json
import socket
import time
import urllib.error
import urllib.request

import msgspec
import openai
import pytest

from mmhandoff.frontend.app import Frontend, FrontendLimits
from mmhandoff.media.fetch import FetchPolicy
from mmhandoff.wire.messages import ChatMessage
from tests.conftest import IMAGE_SERVER_PNG as PNG
from tests.conftest import data_uri, encode, make_image
from tests.conftest import serve_app as _start
from tests.flows import greedy, handoff_run
from tests.test_frontend_request import BAD_CASES, GOOD, chat_body, messages, post

pytestmark = pytest.mark.engine

MODEL = "tiny-llava"


def _frontend(loop, dynamo, **kw):
    _, _, p, d = dynamo
    frontend = Frontend(p, d, MODEL, limits=FrontendLimits(max_body_bytes=2 << 20, max_images=2,
                                                           max_image_bytes=1 << 20), **kw)
    runner = frontend.runner()
    return frontend, runner, _start(loop, runner)


@pytest.fixture(scope="module")
def server(loop, dynamo):
    """Default policy: image URLs may reach public addresses only."""
    frontend, runner, url = _frontend(loop, dynamo)
    yield url
    loop.run(runner.cleanup())


@pytest.fixture(scope="module")
def open_server(loop, dynamo):
    """Loopback allowed for image URLs, through explicit config, as the test image server needs."""
    policy = FetchPolicy(allow_networks=FetchPolicy.networks("127.0.0.0/8"), timeout_s=2)
    frontend, runner, url = _frontend(loop, dynamo, fetch_policy=policy)
    yield frontend, url
    loop.run(runner.cleanup())


def test_chat_with_images_streaming_and_not(loop, open_server, image_server, dynamo):
    prefill, decode, _, _ = dynamo
    _, url = open_server
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)
    assert [m.id for m in client.models.list().data] == [MODEL]
    cases = [
        ([data_uri(encode(make_image(200, 150, 61)))], None),
        ([data_uri(encode(make_image(200, 150, 62))),
          data_uri(encode(make_image(320, 200, 63), "JPEG"), "image/jpeg")], None),
        ([image_server + "/to-img"], [data_uri(PNG)]),  # fetched over http, after a redirect
    ]
    for uris, same_as in cases:
        asked = messages(*uris)
        raw = client.chat.completions.with_raw_response.create(
            model=MODEL, messages=asked, max_tokens=12, temperature=0)
        plain = raw.parse()
        assert raw.headers["x-request-id"] == plain.id
        streamed = "".join(
            c.choices[0].delta.content or "" for c in client.chat.completions.create(
                model=MODEL, messages=asked, max_tokens=12, temperature=0, stream=True)
            if c.choices)
        # reference: the same request through the workers in-process
        typed = msgspec.convert(messages(*(same_as or uris)), list[ChatMessage])
        tokens, _, h = loop.run(handoff_run(prefill, decode, "ref", typed, greedy(12)))
        tokenizer = decode.engine.llm.renderer.get_tokenizer()
        expected = tokenizer.decode(tokens, skip_special_tokens=True)
        assert plain.choices[0].message.content == streamed == expected
        assert plain.usage.prompt_tokens == len(h.token_ids)
        assert plain.usage.completion_tokens == len(tokens)
        stats = plain.model_extra["mmhandoff"]
        assert 0 < stats["request_bytes"] < 4096 and stats["kv_tokens_pulled"] > 0


def test_completions_equal_the_engine_on_the_raw_prompt(loop, server, engines):
    from vllm import SamplingParams

    client = openai.OpenAI(base_url=server + "/v1", api_key="none", max_retries=0, timeout=120)
    prompt = "USER: Say something about blocks. ASSISTANT:"
    plain = client.completions.create(model=MODEL, prompt=prompt, max_tokens=10, temperature=0)
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=10, temperature=0, stream=True) if c.choices)

    async def reference():  # the aggregated engine on the same text, no template
        async for out in engines.full.llm.generate({"prompt": prompt},
                                               SamplingParams(max_tokens=10, temperature=0),
                                               "cmpl-ref"):
            final = out
        return final

    ref = loop.run(reference())
    assert plain.choices[0].text == streamed == ref.outputs[0].text
    assert plain.usage.prompt_tokens == len(ref.prompt_token_ids)


def test_echo_with_logprobs_gives_the_prompts_logprobs_as_vllm_computes_them(loop, server,
                                                                            engines):
    """Completions' echo with logprobs: the prompt's tokens, the first with null logprobs, then
    the answer's, each with its logprob; the prompt's equal what vLLM's own engine computes for
    the same text (`prompt_logprobs`, on the aggregated engine), the answer's its sampled ones.
    Streamed and not, the same entries."""
    from vllm import SamplingParams

    client = openai.OpenAI(base_url=server + "/v1", api_key="none", max_retries=0, timeout=120)
    prompt = "USER: Count the blocks. ASSISTANT:"
    ask = dict(model=MODEL, prompt=prompt, max_tokens=4, temperature=0, echo=True, logprobs=2)
    plain = client.completions.create(**ask)
    streamed: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [],
                                 "text_offset": []}
    text = ""
    for c in client.completions.create(**ask, stream=True):
        if c.choices:
            text += c.choices[0].text
            for field, values in streamed.items():
                values += getattr(c.choices[0].logprobs, field) or []

    async def reference():
        async for out in engines.full.llm.generate(
                {"prompt": prompt},
                SamplingParams(max_tokens=4, temperature=0, logprobs=2, prompt_logprobs=2),
                "cmpl-echo-ref"):
            final = out
        return final

    ref = loop.run(reference())
    lp = plain.choices[0].logprobs
    prompt_ids, answer_ids = list(ref.prompt_token_ids), list(ref.outputs[0].token_ids)
    assert plain.choices[0].text == text == prompt + ref.outputs[0].text
    assert len(lp.tokens) == len(prompt_ids) + len(answer_ids) == plain.usage.total_tokens
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    expected = [ref.prompt_logprobs[i][t].logprob for i, t in enumerate(prompt_ids) if i] + \
        [ref.outputs[0].logprobs[i][t].logprob for i, t in enumerate(answer_ids)]
    # another engine (the agg one) on the same weights: bf16 rounding may differ slightly
    assert lp.token_logprobs[1:] == pytest.approx(expected, abs=0.02)
    for token, logprob, top in zip(lp.tokens[1:], lp.token_logprobs[1:], lp.top_logprobs[1:]):
        # the top 2 and the token itself, keyed by text (two ids may share one)
        assert top[token] == logprob and 1 <= len(top) <= 3
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    assert streamed == {"tokens": lp.tokens, "token_logprobs": lp.token_logprobs,
                        "top_logprobs": lp.top_logprobs, "text_offset": lp.text_offset}


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": "seven " * 3000}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "seven " * 3000}]}),
])
def test_a_prompt_longer_than_the_model_is_a_400(server, path, body):
    """vLLM's own check (the tiny model's context is 2048 tokens) refuses it; the client's
    fault, and the server keeps serving."""
    status, got = post(server, json.dumps({"model": MODEL, "max_tokens": 4, **body}).encode(),
                       path)
    assert (status, got["error"]["code"]) == (400, "invalid_request"), got
    assert "2048" in got["error"]["message"]
    ok_status, ok = post(server, chat_body(GOOD))
    assert ok_status == 200 and ok["choices"][0]["finish_reason"] in ("length", "stop")


@pytest.mark.parametrize("case", ["invalid json", "pixels", "URL to metadata", "bad max_tokens"])
def test_after_a_refusal_the_server_keeps_serving(server, case):
    """Every refusal case runs without workers in test_frontend_request.py; here a few run in
    front of the real ones, each followed by a request that must be answered."""
    body, status, code = BAD_CASES[case]
    got_status, got = post(server, body)
    assert (got_status, got["error"]["code"]) == (status, code)
    ok_status, ok = post(server, chat_body(GOOD))
    assert ok_status == 200 and ok["choices"][0]["finish_reason"] in ("length", "stop")


def _metric(text: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + " ") or line.startswith(name + "{"))


def _engine_states(loop, engines, tag: str) -> dict[str, tuple[float, int]]:
    """{engine: (KV cache usage, unfinished requests)} of prefill and decode, each stepped once
    first so that its load is current."""
    from vllm import SamplingParams

    def state(engine, load, name):
        async def poke():
            async for _ in engine.llm.generate({"prompt": "hi"}, SamplingParams(max_tokens=1),
                                           f"{tag}-{name}-{time.monotonic()}"):
                pass
        loop.run(poke())
        return load.kv_cache_usage, engine.llm.output_processor.get_num_unfinished_requests()

    return {"prefill": state(engines.prefill, engines.prefill_load, "prefill"),
            "decode": state(engines.decode, engines.decode_load, "decode")}


def _back_to(loop, engines, base: dict, within_s: float) -> dict:
    """Polls (bounded) until no engine holds more KV than in `base` or runs a request; returns
    the last state seen."""
    deadline, state = time.monotonic() + within_s, None
    while time.monotonic() < deadline:
        state = _engine_states(loop, engines, "after")
        if _idle(state, base):
            break
        time.sleep(0.2)
    return state


def _idle(state: dict, base: dict) -> bool:
    return all(usage <= base[n][0] and unfinished == 0 for n, (usage, unfinished) in state.items())


def _send_raw(url: str, body: bytes) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    s = socket.create_connection((host, int(port)), timeout=60)
    s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
              b"application/json\r\nContent-Length: " + str(len(body)).encode() +
              b"\r\n\r\n" + body)
    return s


def test_metrics_and_cancellation(loop, open_server, engines):
    """A streaming client that leaves mid-answer: the request is aborted on decode (no request
    running, no KV held on any engine), and /metrics counted it all."""
    frontend, url = open_server

    def scrape() -> str:
        return _scrape(url)

    base = _engine_states(loop, engines, "base")
    before, generated = scrape(), engines.decode_load.generation_tokens

    body = json.dumps({"model": MODEL, "messages": messages(GOOD), "max_tokens": 1000,
                       "temperature": 0, "stream": True, "ignore_eos": True}).encode()
    with _send_raw(url, body) as s:
        got = b""
        while got.count(b"data: ") < 3:  # the answer is flowing
            piece = s.recv(65536)
            assert piece, got
            got += piece
        assert b" 200 " in got.split(b"\r\n", 1)[0]
    running_while = engines.decode.llm.output_processor.get_num_unfinished_requests()
    assert running_while >= 1

    state = _back_to(loop, engines, base, within_s=30)
    assert _idle(state, base), (state, base, running_while)
    # aborted, not run to its end: far fewer than the 1000 tokens asked for were generated
    assert engines.decode_load.generation_tokens - generated < 500

    after = scrape()
    assert _metric(after, "mmhandoff_client_disconnects_total") == \
        _metric(before, "mmhandoff_client_disconnects_total") + 1
    assert _metric(after, 'mmhandoff_requests_total{api="chat"}') >= 1
    assert _metric(after, "mmhandoff_time_to_first_token_seconds_count") >= \
        _metric(before, "mmhandoff_time_to_first_token_seconds_count") + 1
    for name in ("mmhandoff_request_errors_total", "mmhandoff_handoff_bytes_count",
                 "mmhandoff_kv_pulled_tokens_total", "mmhandoff_retries_total",
                 "mmhandoff_inter_token_latency_seconds_count",
                 "mmhandoff_decode_first_token_seconds_count"):
        assert name in after


def test_a_client_that_leaves_during_prefill(loop, open_server, engines):
    """The client goes away while its request is in prefill (a 1600x1200 JPEG, as large as this
    frontend's 2 MiB body limit allows: prefill takes a while). Prefill still finishes and then
    holds the blocks for decode; the frontend hands them to decode and stops it at once, which
    frees them on prefill long before the lease would."""
    _, url = open_server
    base = _engine_states(loop, engines, "base-leave")
    stored = len(engines.prefill_events.stored())
    body = json.dumps({"model": MODEL, "max_tokens": 50, "temperature": 0, "stream": True,
                       "messages": messages(data_uri(encode(make_image(1600, 1200, 71),
                                                                 "JPEG"), "image/jpeg"))}).encode()
    deadline = time.monotonic() + 60
    with _send_raw(url, body):
        while _in_flight(url) < 1:  # checked and on its way to prefill: leave now
            assert time.monotonic() < deadline, "the request never got past the checks"
            time.sleep(0.01)
    while len(engines.prefill_events.stored()) <= stored:  # prefill stored its (new) blocks
        assert time.monotonic() < deadline, "prefill never ran the request"
        time.sleep(0.01)
    # from here prefill would hold the blocks for its lease (8 s): they must be free before
    state = _back_to(loop, engines, base, within_s=engines.lease_s / 2)
    assert _idle(state, base), (state, base, list(engines.decode.llm.output_processor.request_states),
                                list(engines.prefill.llm.output_processor.request_states))


def _scrape(url: str) -> str:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        return r.read().decode()


def _in_flight(url: str) -> float:
    return _metric(_scrape(url), "mmhandoff_requests_in_flight")


def test_health_names_an_endpoint_without_instances(loop, dynamo):
    import asyncio

    from mmhandoff.plane.runtime import runtime

    _, _, p, d = dynamo

    async def missing_client():
        rt = runtime(asyncio.get_running_loop(), discovery="file", request_plane="tcp")
        return rt, await rt.endpoint("mmhtest.missing.generate").client()

    rt, missing = loop.run(missing_client())
    try:
        for decode, status, instances in ((d, 200, 1), (missing, 503, 0)):
            runner = Frontend(p, decode, MODEL).runner()
            url = _start(loop, runner)
            try:
                with urllib.request.urlopen(url + "/health", timeout=10) as r:
                    got_status, body = r.status, json.loads(r.read())
            except urllib.error.HTTPError as e:
                got_status, body = e.code, json.loads(e.read())
            finally:
                loop.run(runner.cleanup())
            assert got_status == status and body["instances"] == {"prefill": 1,
                                                                   "decode": instances}
    finally:
        rt.shutdown()
