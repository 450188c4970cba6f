"""The frontend's answer loop against scripted workers (no engine): typed chunks in, the OpenAI
answer out; a worker's typed error becomes 4xx or 5xx by whose fault it is; decode failing
closed, or a worker lost before the answer started, is retried through prefill a bounded number
of times; a worker lost after it started ends the answer with an error, never a short 200."""

from __future__ import annotations

import asyncio
import json
import time
import urllib.error
import urllib.request

import msgspec
import pytest

from mmhandoff.frontend.app import Frontend
from mmhandoff.wire.handoff import Features, Handoff, Sampling, encode_handoff
from mmhandoff.wire.messages import (
    DecodeChunk,
    DecodeStats,
    FirstToken,
    PrefillAnswer,
    PrefillRequest,
    PrefillStats,
    PromptLogprobs,
    TokenLogprob,
    TopLogprob,
)
from tests.conftest import serve_app
from tests.flows import opened
from tests.local_plane import Item

pytestmark = pytest.mark.unit

MODEL = "tiny-llava"


# Script entries for a worker that is lost: its stream breaks as Dynamo's does when the peer
# dies (a plain exception from the stream), or it stays silent.
LOST = ValueError("Stream ended before generation completed")
SILENT = "silent"


class Scripted:
    """A Dynamo client whose n-th call streams the n-th script (builtin items, LOST, SILENT)."""

    def __init__(self, *scripts) -> None:
        self.scripts, self.requests = list(scripts), []

    def instance_ids(self):
        return [1]

    async def round_robin(self, request, context=None):
        self.requests.append(request)
        script = self.scripts[min(len(self.requests), len(self.scripts)) - 1]

        async def stream():
            for item in script:
                if item is LOST:
                    raise LOST
                if item is SILENT:
                    await asyncio.sleep(3600)
                yield Item(item)
        return stream()


def handoff_answer(rid="r", prompt_tokens=3, first: FirstToken | None = None) -> dict:
    """Prefill's answer: by default the older contract's (no first token: decode samples it)."""
    h = Handoff(v=2, request_id=rid, model_fingerprint="f", token_ids=[1, 2, 3],
                features=Features(mm_hashes={}, mm_placeholders={}), requires_kv=True,
                kv_transfer_params={}, sampling=Sampling(max_tokens=16),
                first_token=None if first is None else first.token_id)
    stats = PrefillStats(images=0, image_bytes=0, prompt_tokens=prompt_tokens, prepare_ms=1.0,
                         prefill_ms=2.0)
    ended = first is not None and first.finish_reason is not None
    return msgspec.to_builtins(PrefillAnswer(first=first,
                                             handoff=None if ended else encode_handoff(h),
                                             stats=stats))


def chunk(text, ids, finish=None, prompt_tokens=3) -> dict:
    stats = DecodeStats(request_bytes=300, prepare_ms=0.5, prompt_tokens=prompt_tokens,
                        kv_tokens_pulled=prompt_tokens) if finish else None
    return msgspec.to_builtins(DecodeChunk(request_id="r", token_ids=ids, text=text,
                                           finish_reason=finish, stats=stats))


def envelope(code, fault, message="no") -> dict:
    return {"error": {"code": code, "message": message, "cause": None, "fault": fault}}


ANSWER = [chunk("Hel", [5]), chunk("lo", [6], "length")]


def ask(loop, prefill, decode, retries=1, stream=False, stall_s=30.0, max_tokens=2, extra=None,
        headers=None, seen=None, **kw):
    """(status, body); a stream's body is its list of SSE data fields. `extra`: more request
    fields; `headers`: more request headers; `seen`, a dict, gets the response's headers and
    the frontend's /metrics after it (under "metrics")."""
    runner = Frontend(prefill, decode, MODEL, retries=retries, stall_s=stall_s, **kw).runner()
    url = serve_app(loop, runner)
    body = json.dumps({"model": MODEL, "max_tokens": max_tokens, "stream": stream,
                       "messages": [{"role": "user", "content": "Hi"}], **(extra or {})}).encode()
    req = urllib.request.Request(url + "/v1/chat/completions", data=body,
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        try:
            with urllib.request.urlopen(req, timeout=30) as r:
                if seen is not None:
                    seen.update(r.headers)
                if stream:
                    return r.status, [line[6:] for line in r.read().decode().split("\n\n")
                                      if line.startswith("data: ")]
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())
    finally:
        if seen is not None:
            with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
                seen["metrics"] = r.read().decode()
        loop.run(runner.cleanup())


def test_a_whole_answer_with_both_tiers_statistics(loop):
    prefill, decode, seen = Scripted([handoff_answer()]), Scripted(ANSWER), {}
    status, got = ask(loop, prefill, decode, seen=seen)
    assert status == 200
    assert got["choices"][0]["message"]["content"] == "Hello"
    assert got["usage"] == {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
    # the usage the clients got, summed on /metrics (what a benchmark client's counts match)
    assert "mmhandoff_prompt_tokens_total 3.0" in seen["metrics"]
    assert "mmhandoff_completion_tokens_total 2.0" in seen["metrics"]
    stats = got["mmhandoff"]
    assert (stats["request_bytes"], stats["kv_tokens_pulled"], stats["retries"]) == (300, 3, 0)
    assert stats["prefill"]["prefill_ms"] == 2.0
    # decode got exactly the handoff prefill made
    assert decode.requests == [{"handoff": handoff_answer()["handoff"]}]


@pytest.mark.parametrize("code, fault, status, kind", [
    ("digest_mismatch", "server", 500, "server_error"),  # a handoff we made, refused: ours
    ("fingerprint_mismatch", "server", 500, "server_error"),
    ("prefill_failed", "server", 503, "server_error"),
    ("invalid_request", "client", 400, "invalid_request_error"),  # e.g. too long a prompt
])
def test_a_workers_error_is_4xx_or_5xx_by_whose_fault_it_is(loop, code, fault, status, kind):
    status_got, got = ask(loop, Scripted([handoff_answer()]), Scripted([envelope(code, fault)]))
    assert (status_got, got["error"]["code"], got["error"]["type"]) == (status, code, kind)


def test_fail_closed_is_retried_through_prefill_then_answered(loop):
    prefill = Scripted([handoff_answer("a")], [handoff_answer("b")])
    decode = Scripted([envelope("kv_coverage", "server")], ANSWER)
    status, got = ask(loop, prefill, decode)
    assert status == 200 and got["mmhandoff"]["retries"] == 1
    assert len(prefill.requests) == 2 and len(decode.requests) == 2


def test_fail_closed_retries_are_bounded(loop):
    prefill = Scripted([handoff_answer()])
    decode = Scripted([envelope("kv_coverage", "server", "no KV")])
    status, got = ask(loop, prefill, decode, retries=2)
    assert (status, got["error"]["code"]) == (503, "kv_coverage")
    assert len(prefill.requests) == len(decode.requests) == 3


@pytest.mark.parametrize("prefill_item, decode_items", [
    ({"stats": handoff_answer()["stats"]}, ANSWER),  # neither a handoff nor the media
    (handoff_answer(), [{"request_id": "r", "text": "x"}]),  # a chunk without token ids
    (handoff_answer(), [{"error": {"message": "no code"}}]),  # an error that is not typed
])
def test_a_malformed_message_between_components_is_our_500(loop, prefill_item, decode_items):
    status, got = ask(loop, Scripted([prefill_item]), Scripted(decode_items))
    assert (status, got["error"]["code"], got["error"]["type"]) == (500, "internal",
                                                                    "server_error")


def test_a_decode_lost_before_its_first_token_is_retried_then_answered(loop):
    """...and the lost call's handoff goes to decode once more, on its own, so that prefill's
    blocks for it are freed now (the claim decides which decode reads them: issue 35)."""
    prefill = Scripted([handoff_answer("a")], [handoff_answer("b")])
    decode = Scripted([LOST], ANSWER)
    status, got = ask(loop, prefill, decode)
    assert status == 200 and got["choices"][0]["message"]["content"] == "Hello"
    assert got["mmhandoff"]["retries"] == 1 and len(prefill.requests) == 2
    for _ in range(100):  # the hand-over runs in the background
        if len(decode.requests) == 3:
            break
        loop.run(asyncio.sleep(0.01))
    handoffs = [r["handoff"] for r in decode.requests]
    a, b = handoff_answer("a")["handoff"], handoff_answer("b")["handoff"]
    assert sorted(handoffs) == sorted([a, a, b])


@pytest.mark.parametrize("scripts, calls, warned", [
    ([[LOST], [LOST], ANSWER], 3, False),  # lost twice on the way, then a decode takes it
    ([[LOST]], 3, True),  # lost every time: the lease frees the blocks; said in the log
    ([[envelope("replayed", "client")]], 1, False),  # a decode claimed it first: its pull frees
    # prefill revoked it unclaimed and freed the blocks itself (or its lease ended)
    ([[envelope("expired", "server")]], 1, False),
], ids=["lost-then-taken", "lost", "claimed-first", "released-by-prefill"])
def test_handing_a_handoff_over_tries_again_when_the_call_is_lost(loop, mmhandoff_log, scripts,
                                                                  calls, warned):
    decode = Scripted(*scripts)
    frontend = Frontend(Scripted(), decode, MODEL)
    answer = msgspec.convert(handoff_answer("a"), PrefillAnswer)
    loop.run(frontend.journey._hand_over(answer))
    assert len(decode.requests) == calls
    assert ("releasing an abandoned handoff failed" in mmhandoff_log.text) == warned


@pytest.mark.parametrize("script, handed", [
    ([LOST], 1),  # lost before any chunk: decode may not have it
    ([chunk("Hel", [5]), LOST], 0),  # decode had it (it streamed): its pull frees the blocks
], ids=["before", "after"])
def test_a_lost_decode_call_hands_the_handoff_over_only_before_its_first_chunk(loop, script,
                                                                              handed):
    from mmhandoff.plane.runtime import RemoteError

    frontend = Frontend(Scripted([handoff_answer("a")]), Scripted(script), MODEL)
    over = []

    def hand_over(answer):  # recorded as it is called, as the failure is raised
        over.append(answer.handoff)
        return asyncio.sleep(0)

    frontend.journey._hand_over = hand_over

    async def attempt():
        with pytest.raises(RemoteError, match="decode_failed"):
            async for _ in frontend.journey.attempt(PrefillRequest(request_id="r", prompt="Hi")):
                pass
    loop.run(attempt())
    assert len(over) == handed


@pytest.mark.parametrize("broken", [
    [chunk("Hel", [5]), LOST],  # the replica died mid-stream
    [chunk("Hel", [5])],  # the stream closed cleanly, but no chunk ended the answer
    [chunk("Hel", [5]), SILENT],  # the replica went silent
], ids=["broken", "closed early", "silent"])
def test_a_decode_lost_mid_answer_is_an_error_never_a_short_answer(loop, broken):
    """Without migration (or past its limit: the same holds for the last replica lost)."""
    status, got = ask(loop, Scripted([handoff_answer()]), Scripted(broken), stall_s=0.5,
                      migration_limit=0)
    assert (status, got["error"]["code"], got["error"]["type"]) == (503, "decode_failed",
                                                                    "server_error")
    status, events = ask(loop, Scripted([handoff_answer()]), Scripted(broken), stream=True,
                         stall_s=0.5, migration_limit=0)
    assert status == 200  # sent with the first token
    first, last = json.loads(events[0]), json.loads(events[-1])
    assert first["choices"][0]["delta"] == {"content": "Hel"}
    assert last["error"]["code"] == "decode_failed" and len(events) == 2  # and no [DONE]


@pytest.mark.parametrize("script", [[LOST], [SILENT]], ids=["died", "silent"])
def test_a_lost_prefill_is_a_503_in_bounded_time(loop, script):
    prefill = Scripted(script)
    t0 = time.monotonic()
    status, got = ask(loop, prefill, Scripted(ANSWER), retries=1, stall_s=0.5)
    assert (status, got["error"]["code"]) == (503, "prefill_failed")
    assert len(prefill.requests) == 2  # retried once (another replica may take it), then 503
    assert time.monotonic() - t0 < 10  # 2 x stall_s, and some slack for a loaded machine


@pytest.mark.parametrize("stream", [False, True])
def test_an_answer_migrates_when_its_decode_replica_is_lost(loop, stream):
    """Prefill gets the prompt again followed by the tokens already sent, with max_tokens for the
    rest; the client sees one answer, its usage counted as if nothing happened."""
    prefill = Scripted([handoff_answer("a")], [handoff_answer("b", prompt_tokens=5)])
    decode = Scripted([chunk("Hel", [5]), chunk("l", [6]), LOST],
                      [chunk("o", [7]), chunk("!", [8], "length", prompt_tokens=5)])
    status, got = ask(loop, prefill, decode, stream=stream, max_tokens=4,
                      extra={"stream_options": {"include_usage": True}} if stream else None)
    assert status == 200
    first, again = prefill.requests
    assert "continuation" not in first or first["continuation"] == []
    assert again["continuation"] == [5, 6] and again["sampling"]["max_tokens"] == 2
    assert again["allow_bypass"] is False  # a continued answer goes through prefill
    changed = ("continuation", "sampling", "allow_bypass")
    assert {k: v for k, v in again.items() if k not in changed} == \
        {k: v for k, v in first.items() if k not in changed}
    if stream:
        *chunks, done = got
        assert done == "[DONE]"
        *parts, last = [json.loads(c) for c in chunks]
        assert "".join(p["choices"][0]["delta"].get("content", "") for p in parts) == "Hello!"
        assert last["choices"] == []
        usage = last["usage"]
    else:
        assert got["choices"][0]["message"]["content"] == "Hello!"
        assert got["mmhandoff"]["migrations"] == 1 and got["mmhandoff"]["retries"] == 0
        usage = got["usage"]
    assert usage == {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}


def test_migrations_are_bounded(loop):
    decode = Scripted([chunk("a", [5]), LOST])  # every replica is lost after one token
    prefill = Scripted([handoff_answer()])
    status, got = ask(loop, prefill, decode, max_tokens=16, migration_limit=2)
    assert (status, got["error"]["code"]) == (503, "decode_failed")
    assert len(prefill.requests) == len(decode.requests) == 3
    assert [len(r.get("continuation", [])) for r in prefill.requests] == [0, 1, 2]


def _streamed(loop, options):
    status, got = ask(loop, Scripted([handoff_answer()]), Scripted(ANSWER), stream=True,
                      extra={"stream_options": options} if options is not None else None)
    assert status == 200 and got[-1] == "[DONE]"
    return [json.loads(c) for c in got[:-1]]


def test_a_stream_has_usage_only_when_asked_as_openai_and_vllm_send_it(loop):
    whole = {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
    for options in (None, {}, {"include_usage": False}):
        assert all("usage" not in c for c in _streamed(loop, options)), options
    *content, last = _streamed(loop, {"include_usage": True})
    assert [c["usage"] for c in content] == [None, None]
    assert (last["choices"], last["usage"], last["id"]) == ([], whole, content[0]["id"])
    *content, last = _streamed(loop, {"include_usage": True, "continuous_usage_stats": True})
    assert [c["usage"]["completion_tokens"] for c in content] == [1, 2]
    assert content[-1]["usage"] == last["usage"] == whole


@pytest.mark.parametrize("fields", [
    {"stream": False, "stream_options": {"include_usage": True}},  # only with stream
    {"stream": True, "stream_options": "yes"},
    {"stream": True, "stream_options": {"include_usage": 1}},
    {"stream": True, "stream_options": {"continuous_usage_stats": "true"}},
    {"stream": "true"},
])
def test_bad_stream_settings_are_400(loop, fields):
    prefill = Scripted([handoff_answer()])
    status, got = ask(loop, prefill, Scripted(ANSWER), extra=fields)
    assert (status, got["error"]["code"]) == (400, "invalid_request")
    assert prefill.requests == []  # refused before any work


def test_a_cache_salt_reaches_prefill_and_a_bad_one_is_400(loop):
    prefill = Scripted([handoff_answer()])
    status, _ = ask(loop, prefill, Scripted(ANSWER), extra={"cache_salt": "tenant-a"})
    assert status == 200 and prefill.requests[0]["cache_salt"] == "tenant-a"
    for bad in ("", 7, "x" * 257):
        prefill = Scripted([handoff_answer()])
        status, got = ask(loop, prefill, Scripted(ANSWER), extra={"cache_salt": bad})
        assert (status, got["error"]["code"]) == (400, "invalid_request") and not prefill.requests


def test_the_frontends_alive_answer_is_its_wire_type(loop):
    from mmhandoff.frontend.app import _alive
    from mmhandoff.wire.messages import Alive

    async def answers():
        return [item async for item in _alive(None)]

    (item,) = loop.run(answers())
    assert msgspec.convert(item, Alive) == Alive(alive=True)


FIRST = FirstToken(token_id=5, text="Hel")


def test_prefills_first_token_is_streamed_and_decode_continues_after_it(loop):
    prefill = Scripted([handoff_answer(first=FIRST)])
    decode = Scripted([chunk("lo", [6], "length", prompt_tokens=3)])
    status, events = ask(loop, prefill, decode, stream=True)
    assert status == 200 and events[-1] == "[DONE]"
    first, rest = json.loads(events[0]), [json.loads(e) for e in events[1:-1]]
    assert first["choices"][0]["delta"] == {"content": "Hel"}  # prefill's, before decode's
    assert "".join(e["choices"][0]["delta"].get("content", "") for e in rest) == "lo"
    assert opened(decode.requests[0]).first_token == 5  # the handoff went on unchanged
    status, got = ask(loop, Scripted([handoff_answer(first=FIRST)]), Scripted(
        [chunk("lo", [6], "length", prompt_tokens=3)]))
    assert got["choices"][0]["message"]["content"] == "Hello"
    assert got["usage"] == {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}


def test_a_retry_after_the_first_token_continues_from_it(loop):
    """Decode failed closed after prefill's token went out: prefill gets the prompt followed by
    that token, with max_tokens for the rest, and its token is the answer's second; the client
    never sees a token twice."""
    second = FirstToken(token_id=6, text="l")
    prefill = Scripted([handoff_answer("a", first=FIRST)],
                       [handoff_answer("b", prompt_tokens=4, first=second)])
    decode = Scripted([envelope("kv_coverage", "server")],
                      [chunk("o", [7], "length", prompt_tokens=4)])
    status, got = ask(loop, prefill, decode, max_tokens=3)
    assert status == 200 and got["choices"][0]["message"]["content"] == "Hello"
    assert got["mmhandoff"]["retries"] == 1 and got["mmhandoff"]["migrations"] == 0
    assert prefill.requests[1]["continuation"] == [5]
    assert prefill.requests[1]["sampling"]["max_tokens"] == 2
    assert got["usage"] == {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6}


def test_a_handoff_whose_client_left_after_the_first_token_still_reaches_decode(loop):
    """Closed right after prefill's token (the client went away as it was written): decode
    still gets the handoff, and pulling it frees prefill's blocks before their lease ends."""
    decode = Scripted([chunk("lo", [6], "length")])
    frontend = Frontend(Scripted([handoff_answer(first=FIRST)]), decode, MODEL)
    request = PrefillRequest(request_id="r", prompt="Hi")

    async def leave_after_first():
        chunks = frontend.journey.attempt(request)
        got, _, from_decode = await anext(chunks)
        await chunks.aclose()
        for _ in range(100):  # the hand-over runs in the background
            if decode.requests:
                break
            await asyncio.sleep(0.01)
        return got, from_decode

    got, from_decode = loop.run(leave_after_first())
    assert (got.token_ids, from_decode) == ([5], False)
    assert decode.requests == [{"handoff": handoff_answer(first=FIRST)["handoff"]}]


def test_penalties_and_stop_strings_let_decode_sample_every_token(loop):
    """vLLM counts presence and frequency penalties over an engine's own output (prefill's token
    would be in decode's prompt, not counted), and holds back streamed text that may begin a stop
    string (prefill's token is streamed at once). Such a request asks prefill for no first
    token."""
    for extra, first_token in (({"presence_penalty": 0.5}, False),
                               ({"frequency_penalty": -1}, False), ({"stop": ["\n"]}, False),
                               ({"response_format": {"type": "json_object"}}, False),
                               ({"repetition_penalty": 1.2}, True), ({}, True)):
        prefill = Scripted([handoff_answer()])
        status, _ = ask(loop, prefill, Scripted(ANSWER), extra=extra)
        assert status == 200 and prefill.requests[0]["first_token"] is first_token, extra


def test_a_migration_counts_min_tokens_over_the_whole_answer(loop):
    prefill = Scripted([handoff_answer("a")], [handoff_answer("b", prompt_tokens=5)])
    decode = Scripted([chunk("Hel", [5]), chunk("l", [6]), LOST],
                      [chunk("o", [7]), chunk("!", [8], "length", prompt_tokens=5)])
    status, _ = ask(loop, prefill, decode, max_tokens=4, extra={"min_tokens": 3})
    assert status == 200
    assert [r["sampling"]["min_tokens"] for r in prefill.requests] == [3, 1]


def test_a_bypassed_handoff_whose_blocks_are_gone_goes_through_prefill(loop):
    """Prefill bypassed its engine (decode held the prompt's KV, it said); decode found the
    blocks evicted and failed closed: the request goes through prefill again, which may not
    bypass this time, and the client gets one answer."""
    bypassed = handoff_answer("a")
    bypassed["stats"]["bypassed"] = True
    prefill = Scripted([bypassed], [handoff_answer("b")])
    decode = Scripted([envelope("kv_coverage", "server")], ANSWER)
    status, got = ask(loop, prefill, decode)
    assert status == 200 and got["choices"][0]["message"]["content"] == "Hello"
    assert [r["allow_bypass"] for r in prefill.requests] == [True, False]
    assert got["mmhandoff"]["retries"] == 1 and not got["mmhandoff"]["prefill"]["bypassed"]


@pytest.mark.parametrize("stream", [False, True])
def test_the_clients_request_id_names_the_answer_everywhere(loop, stream):
    """As vLLM's server: the answer's id is chatcmpl-<X-Request-Id>, the header comes back, and
    prefill and decode get the same id (their logs and engine requests carry it)."""
    prefill, decode, seen = Scripted([handoff_answer()]), Scripted(ANSWER), {}
    status, got = ask(loop, prefill, decode, stream=stream, seen=seen,
                      headers={"X-Request-Id": "trace-42.a:b"})
    assert status == 200 and seen["X-Request-Id"] == "trace-42.a:b"
    first = json.loads(got[0]) if stream else got
    assert first["id"] == "chatcmpl-trace-42.a:b"
    assert prefill.requests[0]["request_id"] == "chatcmpl-trace-42.a:b"
    seen.clear()
    status, got = ask(loop, Scripted([handoff_answer()]), Scripted(ANSWER), stream=stream,
                      seen=seen)
    ours = (json.loads(got[0]) if stream else got)["id"]
    assert ours.startswith("chatcmpl-") and seen["X-Request-Id"] == ours  # none sent: our own


@pytest.mark.parametrize("bad", ["", "x" * 129, "has space", "semi;colon", "ünïcode"])
def test_a_malformed_request_id_is_refused_before_any_work(loop, bad):
    prefill = Scripted([handoff_answer()])
    status, got = ask(loop, prefill, Scripted(ANSWER), headers={"X-Request-Id": bad})
    assert (status, got["error"]["code"]) == (400, "invalid_request_id")
    assert prefill.requests == []


def _lp(token_id, token, logprob, *top) -> TokenLogprob:
    return TokenLogprob(token_id=token_id, token=token, logprob=logprob,
                        top=[TopLogprob(token_id=i, token=t, logprob=p) for i, t, p in top])


def test_logprobs_of_prefills_token_and_decodes_are_one_answers_in_openais_formats(loop):
    """Prefill's first token brings its logprob, decode's chunks theirs: the client gets them in
    order, in the chat format (with bytes), streamed per chunk or whole, and in the completions
    format (parallel lists, text offsets; -inf written as vLLM writes it)."""
    first = FirstToken(token_id=5, text="Hé", logprob=_lp(5, "Hé", -0.5, (5, "Hé", -0.5),
                                                          (9, "x", -1.5)))
    rest = msgspec.to_builtins(DecodeChunk(
        request_id="r", token_ids=[6], text="llo", finish_reason="length",
        stats=DecodeStats(request_bytes=300, prepare_ms=0.5, prompt_tokens=3),
        logprobs=[_lp(6, "llo", float("-inf"), (6, "llo", -0.25), (7, "y", -2.0))]))
    extra = {"logprobs": True, "top_logprobs": 2}
    status, got = ask(loop, Scripted([handoff_answer(first=first)]), Scripted([rest]),
                      extra=extra)
    assert status == 200
    content = got["choices"][0]["logprobs"]["content"]
    assert [(c["token"], c["logprob"], c["bytes"]) for c in content] == [
        ("Hé", -0.5, list("Hé".encode())), ("llo", -9999.0, list(b"llo"))]
    assert [[t["token"] for t in c["top_logprobs"]] for c in content] == [["Hé", "x"],
                                                                         ["llo", "y"]]
    status, events = ask(loop, Scripted([handoff_answer(first=first)]), Scripted([rest]),
                         stream=True, extra=extra)
    streamed = [json.loads(e)["choices"][0]["logprobs"]["content"] for e in events[:-1]]
    assert [[c["token"] for c in part] for part in streamed] == [["Hé"], ["llo"]]
    # not asked: null, as OpenAI and vLLM write it
    status, got = ask(loop, Scripted([handoff_answer(first=FIRST)]), Scripted(ANSWER))
    assert got["choices"][0]["logprobs"] is None


def test_completions_logprobs_are_parallel_lists_with_text_offsets():
    from mmhandoff.frontend import logprobs as oai

    entries = [_lp(5, "Hé", -0.5, (5, "Hé", -0.5), (9, "x", -1.5)),
               _lp(6, "llo", -0.25, (6, "llo", -0.25))]
    assert oai.completion(entries, 3) == {
        "tokens": ["Hé", "llo"], "token_logprobs": [-0.5, -0.25],
        "top_logprobs": [{"Hé": -0.5, "x": -1.5}, {"llo": -0.25}], "text_offset": [3, 5]}


def test_a_structured_answer_lost_mid_answer_ends_with_the_error(loop):
    """Its grammar cannot go on from tokens already sent (they would sit in the prompt): no
    migration, the error instead of a continuation that may break the format."""
    prefill = Scripted([handoff_answer("a")], [handoff_answer("b")])
    decode = Scripted([chunk("{", [5]), LOST], ANSWER)
    status, got = ask(loop, prefill, decode, max_tokens=8,
                      extra={"structured_outputs": {"json_object": True}})
    assert (status, got["error"]["code"]) == (503, "decode_failed")
    assert len(prefill.requests) == 1


@pytest.mark.parametrize("stream", [False, True])
def test_n_answers_are_n_requests_seeded_as_vllm_seeds_them(loop, stream):
    """n = 2: two answers to the prompt, each its own request (vLLM's parallel sampling: the
    i-th with seed + i), as choices 0 and 1; the usage counts the prompt once."""
    prefill = Scripted([handoff_answer()])
    decode = Scripted(ANSWER)
    status, got = ask(loop, prefill, decode, stream=stream,
                      extra={"n": 2, "seed": 7, **({"stream_options": {"include_usage": True}}
                                                  if stream else {})})
    assert status == 200
    ids = sorted(r["request_id"] for r in prefill.requests)
    assert ids[0].endswith("-0") and ids[1].endswith("-1") and ids[0][:-2] == ids[1][:-2]
    assert sorted(r["sampling"]["seed"] for r in prefill.requests) == [7, 8]
    whole = {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}
    if stream:
        events = [json.loads(e) for e in got[:-1]]
        text = {0: "", 1: ""}
        for e in events[:-1]:
            (choice,) = e["choices"]
            text[choice["index"]] += choice["delta"].get("content", "")
        assert text == {0: "Hello", 1: "Hello"}
        assert (events[-1]["choices"], events[-1]["usage"]) == ([], whole)
    else:
        assert [(c["index"], c["message"]["content"]) for c in got["choices"]] == [
            (0, "Hello"), (1, "Hello")]
        assert got["usage"] == whole and len(got["mmhandoff"]) == 2


def test_one_failed_answer_of_n_fails_the_request(loop):
    prefill = Scripted([handoff_answer()])
    decode = Scripted([envelope("digest_mismatch", "server")])
    status, got = ask(loop, prefill, decode, extra={"n": 3})
    assert (status, got["error"]["code"]) == (500, "digest_mismatch")


def test_echo_starts_a_completion_with_its_prompt(loop):
    runner = Frontend(Scripted([handoff_answer()]), Scripted(ANSWER), MODEL).runner()
    url = serve_app(loop, runner)
    try:
        for stream in (False, True):
            body = json.dumps({"model": MODEL, "prompt": "Say: ", "max_tokens": 2, "echo": True,
                               "stream": stream}).encode()
            req = urllib.request.Request(url + "/v1/completions", data=body,
                                         headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=30) as r:
                raw = r.read().decode()
            if stream:
                parts = [json.loads(line[6:]) for line in raw.split("\n\n")
                         if line.startswith("data: {")]
                text = "".join(p["choices"][0]["text"] for p in parts)
            else:
                text = json.loads(raw)["choices"][0]["text"]
            assert text == "Say: Hello", stream
    finally:
        loop.run(runner.cleanup())


def test_echo_with_logprobs_puts_the_prompts_tokens_first(loop):
    """Prefill's answer carries the prompt's logprobs (the first token has none); the client
    gets them before the answer's, in vLLM's completions format, streamed or not."""
    prompt = PromptLogprobs(first_token_id=1, first_token="<s>",
                            rest=[_lp(2, "Say", -2.0, (2, "Say", -2.0), (3, "Do", -2.5))])
    first = FirstToken(token_id=5, text="Hel", logprob=_lp(5, "Hel", -0.5, (5, "Hel", -0.5)))
    answer = msgspec.to_builtins(msgspec.structs.replace(
        msgspec.convert(handoff_answer(first=first), PrefillAnswer), prompt_logprobs=prompt))
    rest = dict(chunk("lo", [6], "length"), logprobs=[msgspec.to_builtins(
        _lp(6, "lo", -1.0, (6, "lo", -1.0)))])
    runner = Frontend(Scripted([answer], [answer]), Scripted([rest], [rest]), MODEL).runner()
    url = serve_app(loop, runner)
    expected = {"tokens": ["<s>", "Say", "Hel", "lo"],
                "token_logprobs": [None, -2.0, -0.5, -1.0],
                "top_logprobs": [None, {"Say": -2.0, "Do": -2.5}, {"Hel": -0.5}, {"lo": -1.0}],
                "text_offset": [0, 3, 6, 9]}  # token texts counted from the first, as vLLM
    try:
        for stream in (False, True):
            body = json.dumps({"model": MODEL, "prompt": "Say", "max_tokens": 2, "echo": True,
                               "logprobs": 1, "stream": stream}).encode()
            req = urllib.request.Request(url + "/v1/completions", data=body,
                                         headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=30) as r:
                raw = r.read().decode()
            if stream:
                got: dict[str, list] = {k: [] for k in expected}
                for part in (json.loads(line[6:]) for line in raw.split("\n\n")
                             if line.startswith("data: {")):
                    for k in got:
                        got[k] += part["choices"][0]["logprobs"][k]
            else:
                got = json.loads(raw)["choices"][0]["logprobs"]
            assert got == expected, stream
    finally:
        loop.run(runner.cleanup())


def test_a_handoff_that_reached_decode_too_late_is_prefilled_again(loop):
    """Decode refuses a handoff past its TTL (prefill's lease may have freed, even reused, its
    blocks): the frontend prefills again, as after a fail-closed refusal."""
    prefill = Scripted([handoff_answer("a")], [handoff_answer("b")])
    decode = Scripted([envelope("expired", "server")], ANSWER)
    status, got = ask(loop, prefill, decode)
    assert status == 200 and got["mmhandoff"]["retries"] == 1


def test_a_handoff_expires_well_inside_prefills_kv_lease():
    from mmhandoff.prefill.worker import HANDOFF_TTL_S, VLLM_KV_LEASE_S, handoff_ttl

    for lease in (8, 30, 120):
        assert 0 < handoff_ttl(lease) <= lease - lease / 3 + 1e-9
    assert handoff_ttl(None) == HANDOFF_TTL_S < VLLM_KV_LEASE_S


def test_a_stopping_frontend_serves_what_it_accepted_and_holds_no_connection_for_the_drain(loop):
    """SIGTERM (Frontend.stop): new connections are refused at once; a connection accepted
    before the stop whose request comes after it is answered (not held unread until the drain
    ends, then closed: aiohttp's own shutdown did that for up to its timeout, 30 s, found by
    the prefill-killed graph test); an answer in flight finishes whole; then the frontend
    closes in well under the drain."""
    import socket
    import threading

    gate = asyncio.Event()

    class Gated(Scripted):  # decode: the answer's last chunk waits for the gate
        async def round_robin(self, request, context=None):
            async def stream():
                yield Item(chunk("Hel", [5]))
                await gate.wait()
                yield Item(chunk("lo", [6], "length"))
            return stream()

    frontend = Frontend(Scripted([handoff_answer()]), Gated(), MODEL)
    runner = frontend.runner()
    url = serve_app(loop, runner)
    port = int(url.rsplit(":", 1)[1])
    got = {}

    def ask_whole():
        body = json.dumps({"model": MODEL, "max_tokens": 2,
                           "messages": [{"role": "user", "content": "Hi"}]}).encode()
        with urllib.request.urlopen(urllib.request.Request(
                url + "/v1/chat/completions", data=body,
                headers={"Content-Type": "application/json"}), timeout=30) as r:
            got["answer"] = json.loads(r.read())["choices"][0]["message"]["content"]
    asking = threading.Thread(target=ask_whole)
    asking.start()

    async def until(condition, within_s=10):
        t0 = time.monotonic()
        while not condition():
            assert time.monotonic() - t0 < within_s
            await asyncio.sleep(0.01)
    loop.run(until(lambda: frontend.answering == 1))
    early = socket.create_connection(("127.0.0.1", port), timeout=10)  # its request comes later
    loop.run(until(lambda: len(runner.server.connections) == 2))
    stopping = asyncio.run_coroutine_threadsafe(frontend.stop(runner, drain_s=30), loop.loop)
    loop.run(until(lambda: not runner.sites))
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", port), timeout=10)
    t0 = time.monotonic()
    early.sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    reply = b""
    while chunk_ := early.recv(65536):
        reply += chunk_
    assert reply.startswith(b"HTTP/1.1 200") and MODEL.encode() in reply, reply[:200]
    assert time.monotonic() - t0 < 2  # answered during the drain, not after it
    assert not stopping.done() and "answer" not in got  # the answer in flight: still draining
    t0 = time.monotonic()
    loop.loop.call_soon_threadsafe(gate.set)
    asking.join(30)
    stopping.result(10)
    assert got["answer"] == "Hello" and time.monotonic() - t0 < 2
