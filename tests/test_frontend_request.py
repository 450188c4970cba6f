"""Every refusal of the frontend, over HTTP, with no worker behind it: each bad request gets its
documented status and code, and nothing is sent on (the backends here fail the test if called).
That the server keeps serving afterwards is checked with real engines in test_frontend.py."""

from __future__ import annotations

import asyncio
import base64
import json
import struct
import urllib.error
import urllib.request
import zlib

import msgspec
import pytest
from PIL import Image

from mmhandoff.frontend.app import Frontend, FrontendLimits
from mmhandoff.frontend.request import ApiError, RequestReader
from mmhandoff.media.fetch import FetchPolicy
from mmhandoff.media.videos import VideoLimits
from tests.conftest import data_uri, encode, make_image, make_video, serve_app

pytestmark = pytest.mark.unit

MODEL = "tiny-llava"
LIMITS = FrontendLimits(max_body_bytes=2 << 20, max_images=2, max_image_bytes=1 << 20,
                        max_videos=1, video=VideoLimits(max_bytes=1 << 20, max_duration_s=5,
                                                        max_frames=100, max_pixels=320 * 240))


class Untouchable:
    """A Dynamo client that records any call; a refused request must make none."""

    def __init__(self) -> None:
        self.calls = 0

    def instance_ids(self):
        return [1]

    async def round_robin(self, *args, **kwargs):
        self.calls += 1
        raise AssertionError("a refused request reached a worker")

    direct = round_robin


@pytest.fixture(scope="module")
def backends():
    return Untouchable(), Untouchable()


def _serve(loop, backends, **kw) -> tuple[str, object]:
    prefill, decode = backends
    runner = Frontend(prefill, decode, MODEL, limits=LIMITS, **kw).runner()
    return serve_app(loop, runner), runner


@pytest.fixture(scope="module")
def server(loop, backends):
    url, runner = _serve(loop, backends)
    yield url
    loop.run(runner.cleanup())


@pytest.fixture(scope="module")
def open_server(loop, backends):
    """Loopback allowed for image URLs (the test image server lives there)."""
    policy = FetchPolicy(allow_networks=FetchPolicy.networks("127.0.0.0/8"), timeout_s=1)
    url, runner = _serve(loop, backends, fetch_policy=policy)
    yield url
    loop.run(runner.cleanup())


def post(url, body: bytes, path="/v1/chat/completions"):
    req = urllib.request.Request(url + path, data=body,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def messages(*uris, text="What is it?"):
    parts = [{"type": "image_url", "image_url": {"url": u}} for u in uris]
    return [{"role": "user", "content": parts + [{"type": "text", "text": text}]}]


def chat_body(*uris, model=MODEL, **kw):
    return json.dumps({"model": model, "messages": messages(*uris), "max_tokens": 4,
                       **kw}).encode()


GOOD = data_uri(encode(make_image(64, 64, 64)))


def png_header(width: int, height: int) -> bytes:
    """A PNG whose header declares width x height and that holds no pixels (a "bomb")."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return (struct.pack(">I", len(data)) + kind + data
                + struct.pack(">I", zlib.crc32(kind + data)))
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b""))
            + chunk(b"IEND", b""))


BAD_CASES = {
    "invalid json": (b"{not json", 400, "invalid_json"),
    "unknown model": (chat_body(GOOD, model="gpt-9"), 404, "model_not_found"),
    "invalid base64": (chat_body("data:image/png;base64,@@@@"), 400, "invalid_base64"),
    "not an image": (chat_body("data:image/png;base64," + base64.b64encode(b"hello").decode()),
                     400, "invalid_image"),
    "too many images": (chat_body(GOOD, GOOD, GOOD), 400, "too_many_images"),
    "body too large": (chat_body(data_uri(b"\0" * (3 << 20))), 413, "body_too_large"),
    "image bytes": (chat_body(data_uri(b"\0" * (1 << 20) + b"\0")), 413, "image_too_large"),
    "pixels": (chat_body(data_uri(encode(Image.new("RGB", (8000, 7000))))), 413,
               "image_too_large"),  # 56 MP in a small PNG
    "URL to 10/8": (chat_body("http://10.1.2.3/x.png"), 400, "image_url_forbidden"),
    "URL to metadata": (chat_body("http://169.254.169.254/latest/meta-data/"), 400,
                        "image_url_forbidden"),
    "URL to localhost": (chat_body("http://localhost:9/x.png"), 400, "image_url_forbidden"),
    "URL to ::1": (chat_body("http://[::1]:9/x.png"), 400, "image_url_forbidden"),
    # IPv6 addresses that carry 127.0.0.1 or the metadata address (each judged by its IPv4)
    **{f"URL to {v6}": (chat_body(f"http://[{v6}]:9/x.png"), 400, "image_url_forbidden")
       for v6 in ("::7f00:1", "::ffff:127.0.0.1", "64:ff9b::7f00:1", "64:ff9b::a9fe:a9fe",
                  "2002:7f00:1::1", "2001:0:4136:e378:8000:63bf:80ff:fffe",
                  "64:ff9b:1::7f00:1")},
    "file URL": (chat_body("file:///etc/passwd"), 400, "invalid_image_url"),
    "server-side path part": (json.dumps({"model": MODEL, "messages": [{"role": "user", "content": [
        {"type": "image", "image": "/etc/passwd"}]}]}).encode(), 400, "invalid_content_part"),
    "no messages": (json.dumps({"model": MODEL, "messages": []}).encode(), 400, "invalid_messages"),
    # OpenAI's shape: image_url is an object {"url": ...} (issue 35: a bare string was answered)
    "image_url a bare string": (json.dumps({"model": MODEL, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": GOOD}]}]}).encode(), 400, "invalid_content_part"),
    "an unknown field": (chat_body(GOOD, max_token=4), 400, "unknown_parameter"),
    "completions' field on chat": (chat_body(GOOD, prompt="x"), 400, "unknown_parameter"),
    "bad max_tokens": (chat_body(GOOD, max_tokens=-3), 400, "invalid_max_tokens"),
    "zero max_tokens": (chat_body(GOOD, max_tokens=0), 400, "invalid_max_tokens"),
    # PIL refuses to open it at all (over twice its own pixel limit)
    "decompression bomb": (chat_body(data_uri(png_header(20000, 20000))), 413,
                           "image_too_large"),
    "JSON nested 50,000 deep": (b'{"model": "' + MODEL.encode() + b'", "messages": '
                                + b"[" * 50_000 + b"]" * 50_000 + b"}", 400, "invalid_json"),
    "negative temperature": (chat_body(GOOD, temperature=-1), 400, "invalid_sampling"),
    "temperature 'nan'": (chat_body(GOOD, temperature="nan"), 400, "invalid_sampling"),
    "temperature true": (chat_body(GOOD, temperature=True), 400, "invalid_sampling"),
    "top_p 2": (chat_body(GOOD, top_p=2), 400, "invalid_sampling"),
    "top_p 0": (chat_body(GOOD, top_p=0), 400, "invalid_sampling"),
    "stop_token_ids not a list": (chat_body(GOOD, stop_token_ids=2), 400, "invalid_sampling"),
    "stop_token_ids negative": (chat_body(GOOD, stop_token_ids=[-1]), 400, "invalid_sampling"),
    "stop_token_ids a string": (chat_body(GOOD, stop_token_ids=["2"]), 400, "invalid_sampling"),
    "stop_token_ids too many": (chat_body(GOOD, stop_token_ids=list(range(65))), 400,
                                "invalid_sampling"),
    # vLLM's own limits (SamplingParams), checked before any work
    "top_k -2": (chat_body(GOOD, top_k=-2), 400, "invalid_sampling"),
    "top_k 1.5": (chat_body(GOOD, top_k=1.5), 400, "invalid_sampling"),
    "min_p 1.5": (chat_body(GOOD, min_p=1.5), 400, "invalid_sampling"),
    "repetition_penalty 0": (chat_body(GOOD, repetition_penalty=0), 400, "invalid_sampling"),
    "presence_penalty 3": (chat_body(GOOD, presence_penalty=3), 400, "invalid_sampling"),
    "frequency_penalty 'x'": (chat_body(GOOD, frequency_penalty="x"), 400, "invalid_sampling"),
    "min_tokens over max_tokens": (chat_body(GOOD, min_tokens=9, max_tokens=8), 400,
                                   "invalid_sampling"),
    "min_tokens negative": (chat_body(GOOD, min_tokens=-1), 400, "invalid_sampling"),
    "stop a number": (chat_body(GOOD, stop=5), 400, "invalid_sampling"),
    "stop with an empty string": (chat_body(GOOD, stop=["a", ""]), 400, "invalid_sampling"),
    "stop too many": (chat_body(GOOD, stop=[str(i) for i in range(17)]), 400,
                      "invalid_sampling"),
    "include_stop_str_in_output 1": (chat_body(GOOD, include_stop_str_in_output=1), 400,
                                     "invalid_sampling"),
    "logit_bias a list": (chat_body(GOOD, logit_bias=[1, 2]), 400, "invalid_sampling"),
    "logit_bias a word key": (chat_body(GOOD, logit_bias={"the": 1}), 400, "invalid_sampling"),
    "logit_bias a negative id": (chat_body(GOOD, logit_bias={"-1": 1}), 400, "invalid_sampling"),
    "logit_bias not a number": (chat_body(GOOD, logit_bias={"5": "x"}), 400, "invalid_sampling"),
    "logit_bias a boolean": (chat_body(GOOD, logit_bias={"5": True}), 400, "invalid_sampling"),
    "logit_bias too many": (chat_body(GOOD, logit_bias={str(i): 1 for i in range(301)}), 400,
                            "invalid_sampling"),
}


@pytest.mark.parametrize("case", list(BAD_CASES))
def test_bad_chat_input_gets_its_4xx_and_reaches_no_worker(server, backends, case):
    body, status, code = BAD_CASES[case]
    got_status, got = post(server, body)
    assert (got_status, got["error"]["code"]) == (status, code)
    assert got["error"]["message"] and got["error"]["type"] == "invalid_request_error"
    assert [b.calls for b in backends] == [0, 0]


def video_body(*urls, **kw):
    parts = [{"type": "video_url", "video_url": {"url": u}} for u in urls]
    return json.dumps({"model": MODEL, "max_tokens": 4, "messages": [
        {"role": "user", "content": parts + [{"type": "text", "text": "What happens?"}]}], **kw}
    ).encode()


CLIP = data_uri(make_video(64, 48, 8, 4.0, 70), "video/mp4")  # within every limit
VIDEO_CASES = {
    "video_url a bare string": (json.dumps({"model": MODEL, "messages": [
        {"role": "user", "content": [{"type": "video_url", "video_url": CLIP}]}]}).encode(),
        400, "invalid_content_part"),
    "video_url without a url": (json.dumps({"model": MODEL, "messages": [
        {"role": "user", "content": [{"type": "video_url", "video_url": {}}]}]}).encode(),
        400, "invalid_video"),
    "not a video": (video_body(data_uri(b"hello, world", "video/mp4")), 400, "invalid_video"),
    "an image as a video": (video_body(data_uri(encode(make_image(64, 64, 71)), "video/mp4")),
                            400, "invalid_video"),
    "a cut-off video": (video_body(data_uri(make_video(64, 48, 8, 4.0, 72)[:2000], "video/mp4")),
                        400, "invalid_video"),
    "an image data URI as a video": (video_body(GOOD), 400, "invalid_video_url"),
    "frames as a JPEG list (vLLM's video/jpeg)": (
        video_body("data:video/jpeg;base64," + ",".join([GOOD.split(",", 1)[1]] * 2)),
        400, "invalid_base64"),
    "invalid base64": (video_body("data:video/mp4;base64,@@@@"), 400, "invalid_base64"),
    "video bytes": (video_body(data_uri(b"\0" * (1 << 20) + b"\0", "video/mp4")), 413,
                    "video_too_large"),
    "frame size": (video_body(data_uri(make_video(640, 480, 2, 2.0, 73), "video/mp4")), 413,
                   "video_too_large"),
    "duration": (video_body(data_uri(make_video(32, 32, 12, 2.0, 74), "video/mp4")), 400,
                 "video_too_long"),  # 6 s
    "frames": (video_body(data_uri(make_video(32, 32, 120, 60.0, 75), "video/mp4")), 400,
               "video_too_long"),  # 2 s, 120 frames
    "too many videos": (video_body(CLIP, CLIP), 400, "too_many_videos"),
    "file URL": (video_body("file:///etc/passwd"), 400, "invalid_video_url"),
    "URL to 10/8": (video_body("http://10.1.2.3/x.mp4"), 400, "video_url_forbidden"),
    "URL to metadata": (video_body("http://169.254.169.254/latest/meta-data/"), 400,
                        "video_url_forbidden"),
}


@pytest.mark.parametrize("case", list(VIDEO_CASES))
def test_bad_video_input_gets_its_4xx_and_reaches_no_worker(server, backends, case):
    body, status, code = VIDEO_CASES[case]
    got_status, got = post(server, body)
    assert (got_status, got["error"]["code"]) == (status, code), got
    assert got["error"]["message"] and got["error"]["type"] == "invalid_request_error"
    assert "image url" not in got["error"]["message"].lower()  # a video's speaks of a video
    assert [b.calls for b in backends] == [0, 0]


def test_a_video_within_the_limits_goes_on_as_its_data_uri():
    """A video that passes the probe is sent on unchanged; one fetched over http(s) becomes a
    data URI of its bytes (tests below: the loopback server)."""
    reader = RequestReader(MODEL, limits=LIMITS)
    request = asyncio.run(reader.chat(json.loads(video_body(CLIP))))
    (part,) = request.media()
    assert part.video_url.url == CLIP


URL_CASES = {  # path on the loopback image server -> (status, code), with loopback allowed
    "/text": (400, "invalid_image"),
    "/big": (413, "image_too_large"),
    "/slow": (400, "image_fetch_failed"),
    "/missing": (400, "image_fetch_failed"),
    "/to-metadata": (400, "image_url_forbidden"),  # a redirect is checked again
}


@pytest.mark.parametrize("path", list(URL_CASES))
def test_image_url_guard_with_loopback_allowed(open_server, image_server, backends, path):
    got_status, got = post(open_server, chat_body(image_server + path))
    assert (got_status, got["error"]["code"]) == URL_CASES[path]
    assert [b.calls for b in backends] == [0, 0]


def test_image_urls_of_one_request_are_bounded_together(loop, image_server, backends):
    """Each 900 KiB body is under the 1 MiB per-image limit; three of them are over the 2 MiB a
    request may fetch (its body limit)."""
    policy = FetchPolicy(allow_networks=FetchPolicy.networks("127.0.0.0/8"), timeout_s=5)
    limits = FrontendLimits(max_body_bytes=2 << 20, max_images=4, max_image_bytes=1 << 20)
    runner = Frontend(*backends, MODEL, limits=limits, fetch_policy=policy).runner()
    url = serve_app(loop, runner)
    try:
        got_status, got = post(url, chat_body(*[image_server + "/900k"] * 3))
        assert (got_status, got["error"]["code"]) == (413, "image_too_large")
        assert "together" in got["error"]["message"]
        got_status, got = post(url, chat_body(*[image_server + "/900k"] * 2))  # 1.8 MiB: read
        assert (got_status, got["error"]["code"]) == (400, "invalid_image")  # (zeros)
    finally:
        loop.run(runner.cleanup())
    assert [b.calls for b in backends] == [0, 0]


@pytest.mark.parametrize("body, status, code", [
    ({"model": MODEL, "prompt": ""}, 400, "invalid_prompt"),
    ({"model": MODEL, "prompt": ["a", "b"]}, 400, "invalid_prompt"),
    ({"model": "nope", "prompt": "x"}, 404, "model_not_found"),
])
def test_bad_completions_input(server, backends, body, status, code):
    got_status, got = post(server, json.dumps(body).encode(), "/v1/completions")
    assert (got_status, got["error"]["code"]) == (status, code)
    assert [b.calls for b in backends] == [0, 0]


def test_an_image_header_longer_than_the_peeked_head_is_read_whole():
    """The frontend decodes only the first HEAD_BYTES of a data URI to read the image header; a
    JPEG whose metadata (here a 100 KB ICC profile) pushes the header past that is still read."""
    import io
    import os

    from mmhandoff.media.images import HEAD_BYTES

    buf = io.BytesIO()
    Image.new("RGB", (64, 48), "red").save(buf, "JPEG", icc_profile=os.urandom(100_000))
    assert buf.tell() > 2 * HEAD_BYTES
    body = json.loads(chat_body(data_uri(buf.getvalue(), "image/jpeg")))
    request = asyncio.run(RequestReader(MODEL).chat(body))
    assert request.image_urls()[0].startswith("data:image/jpeg")
    with pytest.raises(ApiError) as refused:  # the pixel limit sees the real size
        asyncio.run(RequestReader(MODEL, FrontendLimits(max_image_pixels=64 * 48 - 1)).chat(body))
    assert (refused.value.status, refused.value.code) == (413, "image_too_large")


UNAPPLIED_CASES = [("best_of", 3), ("prompt_logprobs", 2),
                   ("guided_json", {"type": "object"}),
                   ("tools", [{"type": "function", "function": {"name": "f"}}]),
                   ("tool_choice", "auto")]


@pytest.mark.parametrize("api, fields, expected", [
    ("chat", {}, (1, False)),
    ("chat", {"n": 3}, (3, False)),
    ("completions", {"n": 2, "echo": True}, (2, True)),
    ("completions", {"echo": False, "n": None}, (1, False)),
    ("chat", {"n": 0}, ("invalid_sampling", "n must be")),
    ("chat", {"n": 17}, ("invalid_sampling", "n must be")),
    ("chat", {"n": True}, ("invalid_sampling", "n must be")),
    ("completions", {"echo": "yes"}, ("invalid_sampling", "echo must be")),
    ("chat", {"echo": True}, ("unsupported_parameter", "echo is not supported")),
    ("completions", {"echo": True, "logprobs": 1}, (1, True)),  # the prompt's logprobs too
])
def test_n_and_echo_are_read_before_any_work(api, fields, expected):
    from mmhandoff.frontend.request import choices

    if isinstance(expected[0], str):
        with pytest.raises(ApiError) as refused:
            choices(fields, api)
        assert refused.value.code == expected[0] and str(refused.value).startswith(expected[1])
    else:
        assert choices(fields, api) == expected


@pytest.mark.parametrize("name, value", UNAPPLIED_CASES)
def test_a_parameter_not_applied_yet_is_refused_not_ignored(server, backends, name, value):
    got_status, got = post(server, chat_body(GOOD, **{name: value}))
    assert (got_status, got["error"]["code"]) == (400, "unsupported_parameter")
    assert name in got["error"]["message"]
    got_status, got = post(server, json.dumps({"model": MODEL, "prompt": "x", name: value})
                           .encode(), "/v1/completions")
    assert (got_status, got["error"]["code"]) == (400, "unsupported_parameter")
    assert [b.calls for b in backends] == [0, 0]


@pytest.mark.parametrize("api, fields, expected", [
    ("chat", {"logprobs": True, "top_logprobs": 3}, 3),
    ("chat", {"logprobs": True}, 0),  # the sampled token's own logprob only
    ("chat", {"logprobs": False, "top_logprobs": 0}, None),
    ("chat", {}, None),
    ("chat", {"top_logprobs": 2}, "top_logprobs needs logprobs: true"),
    ("chat", {"logprobs": True, "top_logprobs": 21}, "top_logprobs must be an integer"),
    ("chat", {"logprobs": 1}, "logprobs must be a boolean"),
    ("completions", {"logprobs": 5}, 5),
    ("completions", {"logprobs": 0}, 0),
    ("completions", {}, None),
    ("completions", {"logprobs": True}, "logprobs must be an integer"),
    ("completions", {"logprobs": 21}, "logprobs must be an integer"),
])
def test_logprobs_are_read_as_vllm_reads_them(api, fields, expected):
    """Chat: `logprobs` (boolean) and `top_logprobs` (how many); completions: `logprobs` (how
    many). Sampling.logprobs: the top tokens per answer token, 0 for the token's own only."""
    reader = RequestReader(MODEL)
    body = ({"model": MODEL, "messages": [{"role": "user", "content": "x"}], **fields}
            if api == "chat" else {"model": MODEL, "prompt": "x", **fields})
    read = reader.chat if api == "chat" else reader.completion
    if isinstance(expected, str):
        with pytest.raises(ApiError) as refused:
            asyncio.run(read(body))
        assert (refused.value.status, refused.value.code) == (400, "invalid_sampling")
        assert str(refused.value).startswith(expected)
    else:
        assert asyncio.run(read(body)).sampling.logprobs == expected


SCHEMA = {"type": "object", "properties": {"a": {"enum": ["x", "y"]}}, "required": ["a"]}


@pytest.mark.parametrize("fields, expected", [
    ({"response_format": {"type": "text"}}, None),
    ({"response_format": {"type": "json_object"}}, {"json_object": True}),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": SCHEMA}}},
     {"json": SCHEMA}),
    ({"structured_outputs": {"choice": ["yes", "no"]}}, {"choice": ["yes", "no"]}),
    ({"structured_outputs": {"regex": "[a-z]+"}}, {"regex": "[a-z]+"}),
    ({"structured_outputs": {"regex": "[a-z]+", "disable_any_whitespace": True}},
     "unsupported_parameter"),  # vLLM 0.31 applies the engine's setting only
    ({"structured_outputs": {"json": SCHEMA}}, {"json": SCHEMA}),
    ({"response_format": {"type": "xml"}}, "invalid_response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "s"}}},
     "invalid_response_format"),
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
     "invalid_response_format"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "invalid_response_format"),
    ({"structured_outputs": {"choice": []}}, "invalid_response_format"),
    ({"structured_outputs": {"grammar": "root ::= 'a'"}}, "unsupported_parameter"),
])
def test_structured_outputs_are_read_as_vllm_reads_them(fields, expected):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], **fields}
    if isinstance(expected, str):
        with pytest.raises(ApiError) as refused:
            asyncio.run(RequestReader(MODEL).chat(body))
        assert (refused.value.status, refused.value.code) == (400, expected)
        return
    structured = asyncio.run(RequestReader(MODEL).chat(body)).sampling.structured
    if expected is None:
        assert structured is None
    else:
        got = {k: v for k, v in msgspec.to_builtins(structured).items()
               if v not in (None, False)}
        assert got == expected


def test_the_values_that_ask_for_nothing_pass_the_check():
    """What clients send by default (openai's and vLLM's benchmark clients fill some in)."""
    from mmhandoff.frontend.request import _refuse_unapplied

    _refuse_unapplied({"best_of": 1, "stop": None, "prompt_logprobs": 0,
                       "presence_penalty": 0.0, "frequency_penalty": 0, "top_k": -1,
                       "repetition_penalty": 1.0, "response_format": {"type": "text"},
                       "tools": [], "tool_choice": "none", "logit_bias": {}, "stop_token_ids": [],
                       "min_p": 0.0, "suffix": None, "guided_json": None})


def test_sampling_settings_reach_the_request_as_vllm_reads_them():
    body = {"model": MODEL, "prompt": "x", "max_tokens": 8, "top_k": -1, "min_p": 0.05,
            "repetition_penalty": 1.3, "presence_penalty": -0.5, "frequency_penalty": 2,
            "min_tokens": 8}
    s = asyncio.run(RequestReader(MODEL).completion(body)).sampling
    assert (s.top_k, s.min_p, s.repetition_penalty, s.presence_penalty, s.frequency_penalty,
            s.min_tokens) == (0, 0.05, 1.3, -0.5, 2.0, 8)  # top_k -1 is vLLM's "off", as 0
    assert s.whole_answer_on_one_engine()
    plain = asyncio.run(RequestReader(MODEL).completion({"model": MODEL, "prompt": "x"})).sampling
    assert (plain.top_k, plain.min_p, plain.repetition_penalty, plain.min_tokens) == (0, 0, 1, 0)
    assert not plain.whole_answer_on_one_engine()
    # logit_bias: as vLLM, each bias clamped to [-100, 100]; it holds for each token alone, so
    # prefill samples the first token
    s = asyncio.run(RequestReader(MODEL).completion(
        {"model": MODEL, "prompt": "x", "logit_bias": {"5": 150, "007": -3.5}})).sampling
    assert s.logit_bias == {"5": 100.0, "7": -3.5} and not s.whole_answer_on_one_engine()
    assert plain.logit_bias is None
    for stop, expected in (("\n", ["\n"]), (["a", "bc"], ["a", "bc"]), ("", []), (None, [])):
        s = asyncio.run(RequestReader(MODEL).completion(
            {"model": MODEL, "prompt": "x", "stop": stop, "include_stop_str_in_output": True}))
        assert (s.sampling.stop, s.sampling.include_stop_str_in_output) == (expected, True)
        assert s.sampling.whole_answer_on_one_engine() == bool(expected)


def test_an_unknown_field_is_named_and_one_to_ignore_changes_nothing():
    """A misspelt or foreign field is refused, naming each; one the operator lists in
    --ignore-fields is ignored: the request read is the one without it."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 3}
    with pytest.raises(ApiError) as refused:
        asyncio.run(RequestReader(MODEL).chat({**body, "nvext": {}, "temprature": 0}))
    assert (refused.value.status, refused.value.code) == (400, "unknown_parameter")
    assert "'nvext', 'temprature'" in str(refused.value)
    reader = RequestReader(MODEL, ignored_fields=frozenset({"nvext"}))
    plain, vendor = (asyncio.run(reader.chat(b)) for b in (body, {**body, "nvext": {"x": 1}}))
    assert msgspec.structs.replace(vendor, request_id=plain.request_id) == plain


def test_every_parameter_the_api_doc_names_is_a_known_field():
    """docs/api.md's tables (applied, refused unless neutral) against the frontend's FIELDS: a
    documented parameter is never an unknown_parameter."""
    import re
    from pathlib import Path

    from mmhandoff.frontend.request import FIELDS

    doc = (Path(__file__).resolve().parents[1] / "docs" / "api.md").read_text()
    rows = [line.split("|")[1] for line in doc.splitlines() if line.startswith("| `")]
    # a row's parameters, not what its remarks in brackets name (parts, nested keys)
    rows = [re.sub(r"\([^()]*\)", "", row) for row in rows]
    named = {n for row in rows for n in re.findall(r"`([a-z_]+)`", row)}
    assert {"max_tokens", "logit_bias", "cache_salt", "messages", "prompt"} <= named
    assert named <= FIELDS["chat"] | FIELDS["completions"], named - FIELDS["chat"] - FIELDS[
        "completions"]
