"""Single use across the graph (prefill.claims, decode.claims): the prefill that holds a
handoff's KV grants it once, so a copy replayed to another decode replica is refused before any
KV is read. On FakeEngine and an in-process plane here; on vLLM in test_admission_engine.py and
through a served graph with two decode replicas in test_graphs.py."""

from __future__ import annotations

import asyncio
import time

import msgspec
import pytest

from mmhandoff.decode import claims as decode_claims
from mmhandoff.decode.claims import ClaimClient
from mmhandoff.decode.worker import DecodeWorker
from mmhandoff.engine.fake import FakeEngine, FakeKV
from mmhandoff.engine.stream import collect
from mmhandoff.prefill.claims import ERRORS, ClaimBook
from mmhandoff.prefill.worker import PrefillWorker
from mmhandoff.wire.handoff import (
    Claim,
    ClaimFailed,
    Expired,
    MalformedHandoff,
    Replayed,
    Unsigned,
    check_admission,
    decode_handoff,
    encode_handoff,
    sign,
)
from tests.local_plane import LocalClient
from tests.test_handoff_message import FP
from tests.test_workers import IMAGES, ask, run

pytestmark = pytest.mark.unit

KEY = b"claims-test-key-" * 2
AT = Claim(endpoint="ns.prefill.claim", instance=1)  # LocalClient's one instance


class Plane:
    """A runtime whose endpoints are in-process handlers (tests.local_plane), counting the
    clients made."""

    def __init__(self, handlers: dict) -> None:
        self.handlers, self.made = handlers, 0

    def endpoint(self, path: str):
        plane = self

        class Endpoint:
            async def client(self):
                plane.made += 1
                return LocalClient(*plane.handlers[path])
        return Endpoint()


def graph(replicas: int = 2):
    """Prefill with a claim book, and `replicas` decode workers that claim through a plane."""
    kv = FakeKV()
    book = ClaimBook(lambda: AT)
    prefill = PrefillWorker(FakeEngine(role="prefill", kv=kv), key=KEY, claims=book)
    plane = Plane({AT.endpoint: (book.handle, ERRORS)})
    decodes = [DecodeWorker(FakeEngine(role="decode", kv=kv), keys=[KEY],
                            claim=ClaimClient(plane)) for _ in range(replicas)]
    return prefill, decodes, book, plane


def test_the_book_grants_each_nonce_once_and_nothing_it_did_not_issue():
    book = ClaimBook(lambda: AT)
    now = time.time()
    h = sign(_handoff(), KEY, ttl_s=20, now=now)
    book.issue(h)
    assert len(book) == 1
    book.claim(h.nonce, "r", now=now + 1)
    with pytest.raises(Replayed):
        book.claim(h.nonce, "r", now=now + 2)
    with pytest.raises(Replayed):  # never issued here (another prefill, or before a restart)
        book.claim("x" * 32, "r", now=now + 2)
    late = sign(_handoff(), KEY, ttl_s=20, now=now)
    book.issue(late)
    with pytest.raises(Expired):
        book.claim(late.nonce, "r", now=now + 21)
    assert len(book) == 0


def test_unclaimed_nonces_are_forgotten_after_their_expiry():
    """Memory is bounded by the handoff rate times the TTL: a handoff nobody claims (its client
    gone, its router dead) leaves the book when it expires."""
    book = ClaimBook(lambda: AT)
    now = time.time()
    for _ in range(50):
        book.issue(sign(_handoff(), KEY, ttl_s=20, now=now))
    kept = sign(_handoff(), KEY, ttl_s=60, now=now)
    book.issue(kept)
    with pytest.raises(Replayed):
        book.claim("x" * 32, "r", now=now + 30)  # any claim prunes, at most once a second
    assert len(book) == 1
    book.claim(kept.nonce, "r", now=now + 31)


def test_handoffs_unclaimed_in_time_are_revoked_once_and_refused_as_expired():
    """Issue 35: a handoff whose delivery was lost is revoked `after_s` after it was issued (its
    KV params handed back for the engine to free); a claimed one is not; a claim that comes
    after the revocation is refused as `expired` (the frontend retries through prefill)."""
    book = ClaimBook(lambda: AT)
    now = time.time()
    handoffs = [msgspec.structs.replace(sign(_handoff(), KEY, ttl_s=20, now=now),
                                        kv_transfer_params={"n": i}) for i in range(4)]
    for i, h in enumerate(handoffs):
        book.issue(h, now=now + i)  # issued one second apart
    book.claim(handoffs[0].nonce, "r0", now=now + 0.5)
    assert book.unsettled() == 3
    assert book.revoke_unclaimed(5.0, now=now + 5.5) == []  # the oldest unclaimed: 4.5 s
    assert book.revoke_unclaimed(5.0, now=now + 7.0) == [{"n": 1}, {"n": 2}]
    assert book.revoke_unclaimed(5.0, now=now + 7.5) == []  # each revoked once
    with pytest.raises(Expired, match="released the KV"):
        book.claim(handoffs[1].nonce, "r1", now=now + 8)
    with pytest.raises(Replayed):  # and refused once only: then it is unknown
        book.claim(handoffs[1].nonce, "r1", now=now + 8)
    book.claim(handoffs[3].nonce, "r3", now=now + 8)  # still in time
    assert book.unsettled() == 0 and book.revoke_unclaimed(5.0, now=now + 30) == []


def test_prefill_frees_the_kv_of_a_handoff_nobody_claims(loop):
    """Issue 35: a handoff issued and never delivered (a crashed frontend's, a dead router's)
    no longer holds prefill's blocks for the lease: `release_unclaimed_s` after it was issued
    prefill revokes it and its engine frees them; one that decode claimed is pulled as before,
    and a late copy of the revoked one is refused as expired with nothing read."""
    kv = FakeKV()
    book = ClaimBook(lambda: AT)
    prefill = PrefillWorker(FakeEngine(role="prefill", kv=kv), key=KEY, claims=book,
                            release_unclaimed_s=1.0)  # (claims come in ms)
    plane = Plane({AT.endpoint: (book.handle, ERRORS)})
    decode = DecodeWorker(FakeEngine(role="decode", kv=kv), keys=[KEY], claim=ClaimClient(plane))
    lost, _ = run(loop, prefill.handoff(ask("Lost?", IMAGES[0])))
    delivered, _ = run(loop, prefill.handoff(ask("Delivered?", IMAGES[1])))
    assert len(kv.blocks) == 2
    tokens, last = run(loop, collect(decode.generate(encode_handoff(delivered))))
    assert last.stats.kv_tokens_pulled > 0 and len(kv.blocks) == 1

    async def freed():
        t0 = time.monotonic()
        while kv.blocks:
            assert time.monotonic() - t0 < 5, "the unclaimed handoff's KV is still held"
            await asyncio.sleep(0.02)
        return time.monotonic() - t0
    run(loop, freed())
    with pytest.raises(Expired):
        run(loop, collect(decode.generate(encode_handoff(lost))))
    assert book.unsettled() == 0
    run(loop, asyncio.wait_for(prefill._releasing, 2))  # and the sweep ends with nothing left


def test_a_claim_needs_a_signed_nonce_and_kv():
    h = _handoff()
    unsigned = decode_handoff(encode_handoff(msgspec.structs.replace(h, claim=AT)))
    with pytest.raises(Unsigned):  # with keys: stripped of its signature
        check_admission(unsigned, fingerprint=FP, keys=[KEY])
    with pytest.raises(MalformedHandoff, match="nonce"):  # an unsigned plane has no nonces
        check_admission(unsigned, fingerprint=FP)
    signed = sign(msgspec.structs.replace(h, claim=AT), KEY, ttl_s=20)
    check_admission(decode_handoff(encode_handoff(signed)), fingerprint=FP, keys=[KEY])
    with pytest.raises(MalformedHandoff, match="names none"):
        decode_handoff(encode_handoff(msgspec.structs.replace(signed, requires_kv=False,
                                                              features=_no_media(h))))


def test_a_handoff_replayed_to_another_decode_replica_is_refused(loop):
    """The issue's case: replica A answers, the same bytes sent to replica B are refused before
    B's engine sees them (no pull); the next honest request is answered as before."""
    prefill, (a, b), book, plane = graph()
    seen = []
    kv_only = b.engine.kv_only

    async def counted(handoff, request_id):
        seen.append(request_id)
        return await kv_only(handoff, request_id)
    b.engine.kv_only = counted
    handoff, _ = run(loop, prefill.handoff(ask("Once?", IMAGES[0])))
    assert handoff.claim == AT and len(book) == 1
    wire = encode_handoff(handoff)
    tokens, last = run(loop, collect(a.generate(wire)))
    assert len(tokens) == 5 and last.stats.kv_tokens_pulled > 0
    assert len(book) == 0
    for replica in (b, a):  # another replica, and the first one again (its own guard)
        with pytest.raises(Replayed):
            run(loop, collect(replica.generate(wire)))
    assert seen == []  # refused before its engine had the request: nothing pulled
    again, _ = run(loop, prefill.handoff(ask("Once?", IMAGES[0])))
    assert run(loop, collect(b.generate(encode_handoff(again))))[0] == tokens
    assert plane.made == 2  # one claim client per replica, made once


def test_claims_fail_closed_when_the_prefill_cannot_be_asked(loop, monkeypatch):
    """A prefill that is gone (its instance not in discovery: its KV went with it), or that fails
    the claim untyped, is `claim_failed` (the frontend retries through prefill), within a bound;
    a decode with no way to claim refuses a handoff that names a claim."""
    monkeypatch.setattr(decode_claims, "DISCOVERY_S", 0.2)
    prefill, (a,), book, plane = graph(1)
    gone = sign(msgspec.structs.replace(_handoff(), claim=Claim(
        endpoint=AT.endpoint, instance=7)), KEY, ttl_s=20)
    t0 = time.monotonic()
    with pytest.raises(ClaimFailed, match="gone"):
        run(loop, a.claim(gone))
    assert time.monotonic() - t0 < 2

    async def broken(request):
        raise RuntimeError("the claim endpoint failed")
        yield  # pragma: no cover
    plane.handlers[AT.endpoint] = (broken, ERRORS)
    a.claim = ClaimClient(plane)
    handoff, _ = run(loop, prefill.handoff(ask("Broken?", IMAGES[1])))
    with pytest.raises(ClaimFailed):
        run(loop, collect(a.generate(encode_handoff(handoff))))
    with pytest.raises(ClaimFailed):
        run(loop, collect(DecodeWorker(a.engine, keys=[KEY]).generate(encode_handoff(handoff))))


def test_requests_waiting_for_a_new_claim_client_share_it(loop):
    prefill, (a,), book, plane = graph(1)
    handoffs = [run(loop, prefill.handoff(ask(f"Together {i}?", IMAGES[0]))) for i in range(4)]

    async def together():
        return await asyncio.gather(*(a.claim(h) for h, _ in handoffs))
    run(loop, together())
    assert plane.made == 1 and len(book) == 0


def _handoff():
    from tests.test_handoff_message import _good

    return _good()


def _no_media(h):
    return msgspec.structs.replace(h.features, mm_hashes={}, mm_placeholders={})
