"""Admission on a live decode engine: each refused handoff gets its typed error before the engine
sees it, and the engine keeps answering correctly."""

from __future__ import annotations

import time

import msgspec
import pytest

from mmhandoff.decode.worker import DecodeWorker, collect
from mmhandoff.engine import EngineInputError
from mmhandoff.prefill.worker import PrefillWorker
from mmhandoff.wire.handoff import (
    DigestMismatch,
    EmptyHash,
    Expired,
    FingerprintMismatch,
    KVMismatch,
    PayloadPresent,
    Replayed,
    SpanOutOfRange,
    SpanReachesFinalToken,
    UnsupportedRequest,
    UnsupportedVersion,
    Unsigned,
    encode_handoff,
    sign,
)
from mmhandoff.wire.messages import PrefillRequest
from tests.conftest import chat, data_uri, encode, make_image
from tests.flows import agg_run, greedy

pytestmark = pytest.mark.engine


@pytest.fixture(scope="module")
def parts(loop, engines):
    prefill = PrefillWorker(engines.prefill)
    messages = chat("Admit me?", data_uri(encode(make_image(120, 90, 42))))
    s = greedy(8, ignore_eos=True)
    h, _ = loop.run(prefill.handoff(PrefillRequest(request_id="adm", messages=messages, sampling=s)))
    return prefill, DecodeWorker(engines.decode), h, messages, s


def _drop_last_block(ids):
    return [g[:-1] for g in ids] if ids and isinstance(ids[0], list) else ids[:-1]


def _span(h, **kw):
    span = h.features.mm_placeholders["image"][0]
    return {**msgspec.to_builtins(span), **kw}


def _repeated(d: dict, times: int) -> None:
    """The prompt `times` over, without the router's block hashes (one per full block of the
    original: the handoff's own rule would refuse it before the engine's checks)."""
    d.update(token_ids=d["token_ids"] * times, block_hashes=None)


CASES = {
    "payload": (lambda d, h: d["features"].update(mm_kwargs={"image": [b"\x01" * 100]}),
                PayloadPresent),
    "empty-hash": (lambda d, h: d["features"]["mm_hashes"].update(image=[""]), EmptyHash),
    "span-out-of-range": (lambda d, h: d["features"]["mm_placeholders"].update(
        image=[_span(h, offset=len(h.token_ids) + 5)]), SpanOutOfRange),
    "span-reaches-final": (lambda d, h: d["features"]["mm_placeholders"].update(
        image=[_span(h, length=len(h.token_ids) - _span(h)["offset"])]), SpanReachesFinalToken),
    "prompt-logprobs": (lambda d, h: d["sampling"].update(prompt_logprobs=1), UnsupportedRequest),
    "wrong-fingerprint": (lambda d, h: d.update(model_fingerprint="0" * 64), FingerprintMismatch),
    "unknown-version": (lambda d, h: d.update(v=99), UnsupportedVersion),
    # what vLLM's own input checks refuse: typed, not an untyped "Internal" error
    "token-past-vocabulary": (lambda d, h: d["token_ids"].__setitem__(0, 100_000),
                              EngineInputError),
    "token-2**40": (lambda d, h: d["token_ids"].__setitem__(0, 2**40), EngineInputError),
    "negative-temperature": (lambda d, h: d["sampling"].update(temperature=-1.0),
                             EngineInputError),
    "top-p-0": (lambda d, h: d["sampling"].update(top_p=0.0), EngineInputError),
    "longer-than-the-model": (lambda d, h: _repeated(d, 40), EngineInputError),
    # more tokens than the named blocks hold: vLLM's pull worker would assert and die
    "more-tokens-than-kv": (lambda d, h: _repeated(d, 2), KVMismatch),
    "fewer-blocks-than-tokens": (lambda d, h: d["kv_transfer_params"].update(
        remote_block_ids=_drop_last_block(d["kv_transfer_params"]["remote_block_ids"])),
        KVMismatch),
}


def test_each_bad_handoff_is_refused_and_the_engine_is_unaffected(loop, engines, parts):
    prefill, decode, h, messages, s = parts
    for name, (mutate, error) in CASES.items():
        d = msgspec.to_builtins(h)
        mutate(d, h)
        with pytest.raises(error):
            loop.run(collect(decode.generate(msgspec.msgpack.encode(d))))
    # the original handoff (its blocks still held by prefill) is still served, and correctly
    tokens, _ = loop.run(collect(decode.generate(encode_handoff(h))))
    assert [h.first_token, *tokens] == loop.run(agg_run(prefill, engines.full, "adm", messages, s))


KEY = b"engine-test-key-" * 2


def test_forged_relabelled_replayed_expired_and_unsigned_handoffs_are_refused(loop, engines):
    """With a key, as every served graph runs: the prefix-cache poisoning of a relabelled
    handoff (image P's KV under image X's hash) and a replay are refused before the engine sees
    them; a later honest request for the same image is answered as agg answers it."""
    prefill = PrefillWorker(engines.prefill, key=KEY)
    decode = DecodeWorker(engines.decode, keys=[KEY])
    s = greedy(8, ignore_eos=True)
    x, p = (chat("Which one?", data_uri(encode(make_image(120, 90, seed)))) for seed in (51, 52))
    h_x, _ = loop.run(prefill.handoff(PrefillRequest(request_id="x", messages=x, sampling=s)))
    h_p, _ = loop.run(prefill.handoff(PrefillRequest(request_id="p", messages=p, sampling=s)))
    relabelled = msgspec.structs.replace(h_p, features=h_x.features)
    unsigned = msgspec.structs.replace(h_p, digest=None, nonce=None, expires_at=None)
    expired = sign(msgspec.structs.replace(h_p, digest=None), KEY, ttl_s=1, now=1.0)
    for bad, error in ((relabelled, DigestMismatch), (unsigned, Unsigned), (expired, Expired)):
        with pytest.raises(error):
            loop.run(collect(decode.generate(encode_handoff(bad))))
    tokens, _ = loop.run(collect(decode.generate(encode_handoff(h_x))))
    with pytest.raises(Replayed):
        loop.run(collect(decode.generate(encode_handoff(h_x))))
    assert [h_x.first_token, *tokens] == loop.run(agg_run(prefill, engines.full, "x", x, s))


def test_a_handoff_replayed_to_another_decode_replica_reads_no_kv(loop, engines):
    """Single use across the graph on vLLM: two decode workers (two replicas' admission, each
    with its own replay guard) claim at the prefill through a plane; the first pulls and
    answers as agg, a copy sent to the other is refused before its engine sees it, and prefill's
    KV usage goes back to its baseline (the pull freed the blocks; nothing holds them for the
    refused copy)."""
    from mmhandoff.decode.claims import ClaimClient
    from mmhandoff.prefill.claims import ERRORS as CLAIM_ERRORS, ClaimBook
    from tests.flows import wait_for_prefill_kv
    from tests.test_claims import AT, Plane

    book = ClaimBook(lambda: AT)
    prefill = PrefillWorker(engines.prefill, key=KEY, claims=book)
    plane = Plane({AT.endpoint: (book.handle, CLAIM_ERRORS)})
    a, b = (DecodeWorker(engines.decode, keys=[KEY], claim=ClaimClient(plane)) for _ in "ab")
    s = greedy(8, ignore_eos=True)
    question = chat("Whose blocks?", data_uri(encode(make_image(120, 90, 53))))
    assert wait_for_prefill_kv(loop, engines, lambda usage: usage == 0.0, 30)
    h, _ = loop.run(prefill.handoff(PrefillRequest(request_id="once", messages=question,
                                                   sampling=s)))
    assert h.claim == AT
    tokens, last = loop.run(collect(a.generate(encode_handoff(h))))
    assert last.stats.kv_tokens_pulled > 0
    with pytest.raises(Replayed, match="not open at its prefill"):
        loop.run(collect(b.generate(encode_handoff(h))))
    assert [h.first_token, *tokens] == loop.run(agg_run(prefill, engines.full, "once", question,
                                                        s))
    assert wait_for_prefill_kv(loop, engines, lambda usage: usage == 0.0, 30)


def test_prefill_frees_an_unclaimed_handoffs_kv_long_before_its_lease(loop, engines):
    """Issue 35 on vLLM: a handoff nobody claims (its delivery lost) is revoked at prefill after
    `release_unclaimed_s` and the engine's connector frees its blocks then, not at the lease's
    end (8 s here); a copy that comes later is refused as expired before decode's engine sees
    it. A handoff claimed in time is pulled and answered as agg, as before."""
    from mmhandoff.decode.claims import ClaimClient
    from mmhandoff.prefill.claims import ERRORS as CLAIM_ERRORS, ClaimBook
    from mmhandoff.wire.handoff import Expired
    from tests.flows import wait_for_prefill_kv
    from tests.test_claims import AT, Plane

    book = ClaimBook(lambda: AT)
    prefill = PrefillWorker(engines.prefill, key=KEY, claims=book, release_unclaimed_s=1.0)
    decode = DecodeWorker(engines.decode, keys=[KEY],
                          claim=ClaimClient(Plane({AT.endpoint: (book.handle, CLAIM_ERRORS)})))
    s = greedy(6, ignore_eos=True)
    question = chat("Who frees it?", data_uri(encode(make_image(120, 90, 57))))
    assert wait_for_prefill_kv(loop, engines, lambda usage: usage == 0.0, 30)
    t0 = time.monotonic()
    lost, _ = loop.run(prefill.handoff(PrefillRequest(request_id="lost", messages=question,
                                                      sampling=s)))
    assert wait_for_prefill_kv(loop, engines, lambda usage: usage > 0.0, 5)
    assert wait_for_prefill_kv(loop, engines, lambda usage: usage == 0.0, engines.lease_s)
    freed_after = time.monotonic() - t0
    assert 1.0 <= freed_after < engines.lease_s / 2, freed_after
    with pytest.raises(Expired, match="released the KV"):
        loop.run(collect(decode.generate(encode_handoff(lost))))
    kept, _ = loop.run(prefill.handoff(PrefillRequest(request_id="kept", messages=question,
                                                      sampling=s)))
    tokens, last = loop.run(collect(decode.generate(encode_handoff(kept))))
    assert last.stats.kv_tokens_pulled > 0
    assert [kept.first_token, *tokens] == loop.run(agg_run(prefill, engines.full, "kept",
                                                           question, s))
    assert wait_for_prefill_kv(loop, engines, lambda usage: usage == 0.0, 30)
