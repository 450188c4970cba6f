"""The frontend's answer loop against scripted workers (no engine): typed chunks in, the OpenAI
answer out; a worker's typed error becomes 4xx or 5xx by whose fault it is; decode failing
closed is retried through prefill a bounded number of times."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import msgspec
import pytest

from mmhandoff.frontend.app import Frontend
from mmhandoff.wire.handoff import Features, Handoff, Sampling
from mmhandoff.wire.messages import (
    DecodeChunk,
    DecodeStats,
    PrefillAnswer,
    PrefillStats,
)
from tests.conftest import serve_app
from tests.local_plane import Item

pytestmark = pytest.mark.unit

MODEL = "tiny-llava"


class Scripted:
    """A Dynamo client whose n-th call streams the n-th script (a list of builtin items)."""

    def __init__(self, *scripts) -> None:
        self.scripts, self.requests = list(scripts), []

    def instance_ids(self):
        return [1]

    async def round_robin(self, request, context=None):
        self.requests.append(request)
        script = self.scripts[min(len(self.requests), len(self.scripts)) - 1]

        async def stream():
            for item in script:
                yield Item(item)
        return stream()


def handoff_answer(rid="r") -> dict:
    h = Handoff(v=1, request_id=rid, model_fingerprint="f", token_ids=[1, 2, 3],
                features=Features(mm_hashes={}, mm_placeholders={}), requires_kv=True,
                kv_transfer_params={}, sampling=Sampling())
    stats = PrefillStats(images=0, image_bytes=0, prompt_tokens=3, prepare_ms=1.0,
                         prefill_ms=2.0)
    return msgspec.to_builtins(PrefillAnswer(handoff=h, stats=stats))


def chunk(text, ids, finish=None) -> dict:
    stats = DecodeStats(request_bytes=300, prepare_ms=0.5, prompt_tokens=3,
                        kv_tokens_pulled=3) if finish else None
    return msgspec.to_builtins(DecodeChunk(request_id="r", token_ids=ids, text=text,
                                           finish_reason=finish, stats=stats))


def envelope(code, fault, message="no") -> dict:
    return {"error": {"code": code, "message": message, "cause": None, "fault": fault}}


ANSWER = [chunk("Hel", [5]), chunk("lo", [6], "length")]


def ask(loop, prefill, decode, retries=1):
    runner = Frontend(prefill, decode, MODEL, retries=retries).runner()
    url = serve_app(loop, runner)
    body = json.dumps({"model": MODEL, "max_tokens": 2,
                       "messages": [{"role": "user", "content": "Hi"}]}).encode()
    req = urllib.request.Request(url + "/v1/chat/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    try:
        try:
            with urllib.request.urlopen(req, timeout=30) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())
    finally:
        loop.run(runner.cleanup())


def test_a_whole_answer_with_both_tiers_statistics(loop):
    prefill, decode = Scripted([handoff_answer()]), Scripted(ANSWER)
    status, got = ask(loop, prefill, decode)
    assert status == 200
    assert got["choices"][0]["message"]["content"] == "Hello"
    assert got["usage"] == {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
    stats = got["mmhandoff"]
    assert (stats["request_bytes"], stats["kv_tokens_pulled"], stats["retries"]) == (300, 3, 0)
    assert stats["prefill"]["prefill_ms"] == 2.0
    # decode got exactly the handoff prefill made
    assert decode.requests == [handoff_answer()["handoff"]]


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
