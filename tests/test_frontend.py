"""The OpenAI-compatible frontend over the Dynamo endpoints, driven by the official openai client."""

from __future__ import annotations

import base64
import json
import urllib.error
import urllib.request

import openai
import pytest

from components.frontend import Frontend, FrontendLimits
from tests.conftest import data_uri, encode, free_port, make_image
from tests.flows import greedy, handoff_run

MODEL = "tiny-llava"


@pytest.fixture(scope="module")
def server(loop, dynamo):
    from aiohttp import web

    _, _, p, d = dynamo
    port = free_port()
    limits = FrontendLimits(max_body_bytes=2 * 1024 * 1024, max_images=2)

    async def up():
        runner = web.AppRunner(Frontend(p, d, MODEL, limits=limits).app())
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        return runner

    runner = loop.run(up())
    yield f"http://127.0.0.1:{port}"
    loop.run(runner.cleanup())


def _messages(*uris, text="What is it?"):
    parts = [{"type": "image_url", "image_url": {"url": u}} for u in uris]
    return [{"role": "user", "content": parts + [{"type": "text", "text": text}]}]


def test_chat_with_images_streaming_and_not(loop, server, dynamo):
    prefill, decode, _, _ = dynamo
    client = openai.OpenAI(base_url=server + "/v1", api_key="none", max_retries=0, timeout=120)
    assert [m.id for m in client.models.list().data] == [MODEL]
    for uris in ([data_uri(encode(make_image(200, 150, 61)))],
                 [data_uri(encode(make_image(200, 150, 62))),
                  data_uri(encode(make_image(320, 200, 63), "JPEG"), "image/jpeg")]):
        messages = _messages(*uris)
        plain = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12,
                                               temperature=0)
        streamed = "".join(
            c.choices[0].delta.content or "" for c in client.chat.completions.create(
                model=MODEL, messages=messages, max_tokens=12, temperature=0, stream=True)
            if c.choices)
        # reference: the same request through the workers in-process
        tokens, _, h = loop.run(handoff_run(prefill, decode, "ref", messages, greedy(12)))
        expected = decode.engine.renderer.get_tokenizer().decode(tokens, skip_special_tokens=True)
        assert plain.choices[0].message.content == streamed == expected
        assert plain.usage.prompt_tokens == len(h.token_ids)
        assert plain.usage.completion_tokens == len(tokens)


def _post(server, body: bytes, content_type="application/json"):
    req = urllib.request.Request(server + "/v1/chat/completions", data=body,
                                 headers={"Content-Type": content_type})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _chat_body(*uris, model=MODEL, **kw):
    return json.dumps({"model": model, "messages": _messages(*uris), "max_tokens": 4, **kw}).encode()


GOOD = data_uri(encode(make_image(64, 64, 64)))
BAD_CASES = {
    "invalid json": (b"{not json", 400, "invalid_json"),
    "unknown model": (_chat_body(GOOD, model="gpt-9"), 404, "model_not_found"),
    "invalid base64": (_chat_body("data:image/png;base64,@@@@"), 400, "invalid_base64"),
    "not an image": (_chat_body("data:image/png;base64," + base64.b64encode(b"hello").decode()),
                     400, "invalid_image"),
    "too many images": (_chat_body(GOOD, GOOD, GOOD), 400, "too_many_images"),
    "body too large": (_chat_body(data_uri(b"\0" * (3 * 1024 * 1024))), 413, "body_too_large"),
    "image URL": (_chat_body("http://127.0.0.1:1/x.png"), 400, "image_url_not_supported"),
    "no messages": (json.dumps({"model": MODEL, "messages": []}).encode(), 400, "invalid_messages"),
    "bad max_tokens": (_chat_body(GOOD, max_tokens=-3), 400, "invalid_max_tokens"),
}


@pytest.mark.parametrize("case", list(BAD_CASES))
def test_bad_input_gets_a_4xx_and_the_server_keeps_serving(server, case):
    body, status, code = BAD_CASES[case]
    got_status, got = _post(server, body)
    assert (got_status, got["error"]["code"]) == (status, code)
    assert got["error"]["message"]
    ok_status, ok = _post(server, _chat_body(GOOD))
    assert ok_status == 200 and ok["choices"][0]["finish_reason"] in ("length", "stop")
