"""The Handoff wire message: lossless round trip, and a typed error for anything malformed."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mmhandoff.wire.handoff import (
    VERSION,
    DigestMismatch,
    EmptyHash,
    FeatureMismatch,
    Features,
    FingerprintMismatch,
    Handoff,
    HandoffError,
    KVRequired,
    MalformedHandoff,
    PayloadPresent,
    Sampling,
    Span,
    SpanOutOfRange,
    SpanReachesFinalToken,
    UnsupportedRequest,
    UnsupportedVersion,
    check_admission,
    decode_handoff,
    encode_handoff,
    sign,
)

pytestmark = pytest.mark.unit

FP = "f" * 64


@st.composite
def handoffs(draw):
    n_images = draw(st.integers(0, 3))
    lengths = [draw(st.integers(1, 40)) for _ in range(n_images)]
    gaps = [draw(st.integers(0, 5)) for _ in range(n_images)]
    spans, pos = [], draw(st.integers(0, 5))
    for gap, length in zip(gaps, lengths):
        pos += gap
        mask = draw(st.one_of(st.none(), st.lists(st.booleans(), min_size=length, max_size=length)))
        spans.append(Span(offset=pos, length=length, is_embed=mask))
        pos += length
    n_tokens = pos + draw(st.integers(1, 20))
    hashes = [draw(st.text(min_size=1, max_size=64)) for _ in range(n_images)]
    return Handoff(
        v=VERSION, request_id=draw(st.text(min_size=1, max_size=20)), model_fingerprint=FP,
        token_ids=draw(st.lists(st.integers(0, 2**31 - 1), min_size=n_tokens, max_size=n_tokens)),
        features=Features(mm_hashes={"image": hashes} if n_images else {},
                          mm_placeholders={"image": spans} if n_images else {}),
        requires_kv=True,
        kv_transfer_params=draw(st.dictionaries(st.text(max_size=8), st.integers(-2**63, 2**63 - 1), max_size=3)),
        sampling=Sampling(max_tokens=draw(st.integers(1, 4096)),
                          temperature=draw(st.floats(0, 2)), seed=draw(st.none() | st.integers(0, 99))),
        cache_salt=draw(st.none() | st.text(max_size=8)),
    )


@settings(max_examples=200, deadline=None)
@given(handoffs())
def test_round_trip_is_lossless(h):
    assert decode_handoff(encode_handoff(h)) == h
    check_admission(h, fingerprint=FP)


@settings(max_examples=300, deadline=None)
@given(handoffs(), st.data())
def test_truncated_messages_get_a_typed_error(h, data):
    wire = encode_handoff(h)
    cut = data.draw(st.integers(0, len(wire) - 1))
    with pytest.raises(HandoffError):
        decode_handoff(wire[:cut])


@settings(max_examples=300, deadline=None)
@given(handoffs(), st.data())
def test_corrupted_messages_never_crash(h, data):
    wire = bytearray(encode_handoff(h))
    for _ in range(data.draw(st.integers(1, 4))):
        wire[data.draw(st.integers(0, len(wire) - 1))] = data.draw(st.integers(0, 255))
    try:
        decode_handoff(bytes(wire))
    except HandoffError:
        pass  # anything but a typed error fails the test


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200))
def test_arbitrary_bytes_never_crash(blob):
    try:
        decode_handoff(blob)
    except HandoffError:
        pass


def _good(**kw) -> Handoff:
    base = dict(v=VERSION, request_id="r", model_fingerprint=FP, token_ids=list(range(10)),
                features=Features(mm_hashes={"image": ["abc"]},
                                  mm_placeholders={"image": [Span(offset=2, length=4)]}),
                requires_kv=True, kv_transfer_params={}, sampling=Sampling())
    base.update(kw)
    return Handoff(**base)


def _raw(h: Handoff) -> dict:
    return msgspec.to_builtins(h)


def _wire(d: dict) -> bytes:
    return msgspec.msgpack.encode(d)


@pytest.mark.parametrize("mutate, error", [
    (lambda d: d["features"].update(mm_kwargs={"image": [b"\x00" * 64]}), PayloadPresent),
    (lambda d: d["features"].update(pixel_values=[[0.1]]), PayloadPresent),
    (lambda d: d["features"].update(whatever=[1]), PayloadPresent),
    (lambda d: d["features"]["mm_hashes"].update(image=[""]), EmptyHash),
    (lambda d: d["features"]["mm_placeholders"]["image"][0].update(offset=8), SpanOutOfRange),
    (lambda d: d["features"]["mm_placeholders"]["image"][0].update(offset=-1), SpanOutOfRange),
    (lambda d: d["features"]["mm_placeholders"]["image"][0].update(length=0), SpanOutOfRange),
    (lambda d: d["features"]["mm_placeholders"]["image"][0].update(offset=6), SpanReachesFinalToken),
    (lambda d: d["features"]["mm_hashes"].update(image=["a", "b"]), FeatureMismatch),
    (lambda d: d["features"]["mm_hashes"].update(video=["a"]), FeatureMismatch),
    (lambda d: d.update(v=2), UnsupportedVersion),
    (lambda d: d.update(v="1"), UnsupportedVersion),
    (lambda d: d.pop("v"), UnsupportedVersion),
    (lambda d: d.update(token_ids=[]), MalformedHandoff),
    (lambda d: d.update(token_ids="abc"), MalformedHandoff),
    (lambda d: d.pop("kv_transfer_params"), MalformedHandoff),
    (lambda d: d.update(extra_field=1), MalformedHandoff),
])
def test_each_structural_rule_has_its_error(mutate, error):
    d = _raw(_good())
    mutate(d)
    with pytest.raises(error):
        decode_handoff(_wire(d))


def test_not_a_map_is_malformed():
    with pytest.raises(MalformedHandoff):
        decode_handoff(msgspec.msgpack.encode([1, 2, 3]))


def test_admission_rules():
    with pytest.raises(UnsupportedRequest):
        check_admission(_good(sampling=Sampling(prompt_logprobs=1)), fingerprint=FP)
    with pytest.raises(FingerprintMismatch):
        check_admission(_good(), fingerprint="0" * 64)
    with pytest.raises(KVRequired):
        check_admission(_good(requires_kv=False), fingerprint=FP)


def test_digest_signs_and_detects_tampering():
    key = b"secret"
    signed = sign(_good(), key)
    check_admission(decode_handoff(encode_handoff(signed)), fingerprint=FP, key=key)
    tampered = msgspec.structs.replace(signed, token_ids=list(range(1, 11)))
    with pytest.raises(DigestMismatch):
        check_admission(tampered, fingerprint=FP, key=key)
    with pytest.raises(DigestMismatch):
        check_admission(_good(), fingerprint=FP, key=key)  # unsigned where a key is required


def test_repr_hides_token_ids():
    text = repr(_good(token_ids=list(range(1000, 1010))))
    assert "1005" not in text and "tokens=10" in text
