"""The Handoff wire message: lossless round trip, and a typed error for anything malformed."""

from __future__ import annotations

import time

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mmhandoff.wire.messages import HandoffMessage, handoff_bytes
from mmhandoff.wire.handoff import (
    VERSION,
    BlockHashes,
    Claim,
    DigestMismatch,
    EmptyHash,
    Expired,
    FeatureMismatch,
    Features,
    FingerprintMismatch,
    Grid,
    GridRules,
    Handoff,
    HandoffError,
    KVRequired,
    MalformedHandoff,
    PayloadPresent,
    PositionStateMismatch,
    PositionStateMissing,
    PositionStateUnexpected,
    Replayed,
    ReplayGuard,
    Sampling,
    Span,
    SpanOutOfRange,
    SpanReachesFinalToken,
    UnsupportedRequest,
    UnsupportedVersion,
    Unsigned,
    authentic,
    check_admission,
    decode_handoff,
    encode_handoff,
    routing_view,
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
    grids = None  # or, as an M-RoPE model with a 2x2 merge has them, one grid an image:
    if draw(st.booleans()):
        rows = [draw(st.sampled_from([d for d in range(1, n + 1) if n % d == 0])) for n in lengths]
        grids = [Grid(t=1, h=2 * r, w=2 * n // r) for r, n in zip(rows, lengths)]
    return Handoff(
        v=VERSION, request_id=draw(st.text(min_size=1, max_size=20)), model_fingerprint=FP,
        token_ids=draw(st.lists(st.integers(0, 2**31 - 1), min_size=n_tokens, max_size=n_tokens)),
        features=Features(mm_hashes={"image": hashes} if n_images else {},
                          mm_placeholders={"image": spans} if n_images else {},
                          mm_grids=None if grids is None else {"image": grids} if n_images else {}),
        requires_kv=True,
        kv_transfer_params=draw(st.dictionaries(st.text(max_size=8), st.integers(-2**63, 2**63 - 1), max_size=3)),
        sampling=Sampling(max_tokens=draw(st.integers(1, 4096)),
                          temperature=draw(st.floats(0, 2)), seed=draw(st.none() | st.integers(0, 99))),
        cache_salt=draw(st.none() | st.text(max_size=8)),
        block_hashes=draw(st.none() | st.integers(1, 8).flatmap(lambda size: st.builds(
            BlockHashes, block_size=st.just(size), hashes=st.lists(
                st.integers(0, 2**64 - 1), min_size=n_tokens // size,
                max_size=n_tokens // size)))),
        **draw(st.just({}) | st.builds(lambda endpoint, instance: dict(
            nonce="n" * 32, expires_at=1e10, claim=Claim(endpoint=endpoint, instance=instance)),
            st.text(min_size=1, max_size=30), st.integers(0, 2**64 - 1))),
    )


@settings(max_examples=100, deadline=None)
@given(handoffs())
def test_round_trip_is_lossless(h):
    assert decode_handoff(encode_handoff(h)) == h
    assert decode_handoff(handoff_bytes(msgspec.to_builtins(h))) == h  # an older frontend's form
    message = msgspec.to_builtins(HandoffMessage(encode_handoff(h)))  # as the router gets it
    assert decode_handoff(handoff_bytes(message)) == h
    check_admission(h, fingerprint=FP, grid_rules=None if h.features.mm_grids is None else GridRules(2))


@settings(max_examples=150, deadline=None)
@given(handoffs(), st.data())
def test_truncated_messages_get_a_typed_error(h, data):
    wire = encode_handoff(h)
    cut = data.draw(st.integers(0, len(wire) - 1))
    with pytest.raises(HandoffError):
        decode_handoff(wire[:cut])


@settings(max_examples=150, deadline=None)
@given(handoffs(), st.data())
def test_corrupted_messages_never_crash(h, data):
    wire = bytearray(encode_handoff(h))
    for _ in range(data.draw(st.integers(1, 4))):
        wire[data.draw(st.integers(0, len(wire) - 1))] = data.draw(st.integers(0, 255))
    try:
        decode_handoff(bytes(wire))
    except HandoffError:
        pass  # anything but a typed error fails the test


def test_a_version_that_is_no_number_is_a_typed_error():
    """Found by the property above: a corrupted `v` that decodes to a map made the version
    check itself crash (a dict is unhashable)."""
    for v in ({}, [], {"a": 1}, "1", 1.0, True, None):
        wire = msgspec.msgpack.encode({**msgspec.to_builtins(_good()), "v": v})
        with pytest.raises(UnsupportedVersion):
            decode_handoff(wire)


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
    # the position state (v5): one grid per item, positive sizes, nothing else in a grid
    (lambda d: d["features"].update(mm_grids={"image": []}), PositionStateMismatch),
    (lambda d: d["features"].update(mm_grids={"image": [{"t": 1, "h": 0, "w": 4}]}),
     PositionStateMismatch),
    (lambda d: d["features"].update(mm_grids={"video": [{"t": 1, "h": 2, "w": 2}]}),
     PositionStateMismatch),
    (lambda d: d["features"].update(mm_grids={"image": [{"t": 1, "h": 4, "w": 4,
                                                         "pixel_values": [0.5]}]}), PayloadPresent),
    (lambda d: d["features"].update(mm_grids={"image": [{"t": 1, "h": 4}]}), MalformedHandoff),
    (lambda d: d.update(v=4, features=dict(d["features"], mm_grids={"image": [
        {"t": 1, "h": 4, "w": 4}]})), MalformedHandoff),
    (lambda d: d.update(v=4, sampling={"logit_bias": {"5": 1.0}}), MalformedHandoff),  # v5
    (lambda d: d.update(sampling={"logit_bias": {"5": "x"}}), MalformedHandoff),
    # the block hashes (v6): one per full block
    (lambda d: d.update(block_hashes={"block_size": 4, "hashes": [1]}), MalformedHandoff),
    (lambda d: d.update(block_hashes={"block_size": 4, "hashes": [1, 2, 3]}), MalformedHandoff),
    (lambda d: d.update(block_hashes={"block_size": 0, "hashes": []}), MalformedHandoff),
    (lambda d: d.update(block_hashes={"block_size": 4, "hashes": ["a", "b"]}), MalformedHandoff),
    (lambda d: d.update(v=5, block_hashes={"block_size": 4, "hashes": [1, 2]}), MalformedHandoff),
    (lambda d: d["features"]["mm_placeholders"]["image"][0].update(offset=8), SpanOutOfRange),
    (lambda d: d["features"]["mm_placeholders"]["image"][0].update(offset=-1), SpanOutOfRange),
    (lambda d: d["features"]["mm_placeholders"]["image"][0].update(length=0), SpanOutOfRange),
    (lambda d: d["features"]["mm_placeholders"]["image"][0].update(offset=6), SpanReachesFinalToken),
    (lambda d: d["features"]["mm_hashes"].update(image=["a", "b"]), FeatureMismatch),
    (lambda d: d["features"]["mm_hashes"].update(video=["a"]), FeatureMismatch),
    (lambda d: d.update(v=VERSION + 1), UnsupportedVersion),
    (lambda d: d.update(v=0), UnsupportedVersion),
    (lambda d: d.update(v="1"), UnsupportedVersion),
    (lambda d: d.pop("v"), UnsupportedVersion),
    (lambda d: d.update(token_ids=[]), MalformedHandoff),
    (lambda d: d["token_ids"].__setitem__(3, -1), MalformedHandoff),
    (lambda d: d.update(token_ids="abc"), MalformedHandoff),
    (lambda d: d.pop("kv_transfer_params"), MalformedHandoff),
    (lambda d: d.update(extra_field=1), MalformedHandoff),
    (lambda d: d.update(continued=-1), MalformedHandoff),
    (lambda d: d.update(continued=len(d["token_ids"])), MalformedHandoff),  # no prompt left
    (lambda d: d.update(first_token=-1), MalformedHandoff),
    (lambda d: d.update(first_token=5, v=1), MalformedHandoff),  # a v2 field
    *[(lambda d, k=k, v=v: d.update(v=2, sampling={k: v}), MalformedHandoff)  # v3 fields
      for k, v in (("min_p", 0.1), ("min_tokens", 1), ("repetition_penalty", 1.1),
                   ("presence_penalty", 0.5), ("frequency_penalty", -0.5), ("stop", ["x"]),
                   ("include_stop_str_in_output", True))],
    (lambda d: d.update(sampling={"max_tokens": 4, "min_tokens": 5}), MalformedHandoff),
    (lambda d: d.update(first_token=5, sampling={"max_tokens": 1}), MalformedHandoff),
    # structured outputs (v4): decode samples the whole structured answer
    (lambda d: d.update(v=3, sampling={"structured": {"regex": "a+"}}), MalformedHandoff),
    (lambda d: d.update(first_token=5, sampling={"structured": {"regex": "a+"}}),
     MalformedHandoff),
    (lambda d: d.update(continued=2, sampling={"structured": {"regex": "a+"}}),
     MalformedHandoff),
    (lambda d: d.update(sampling={"structured": {"regex": "a+", "choice": ["x"]}}),
     MalformedHandoff),  # two constraints
    (lambda d: d.update(sampling={"structured": {}}), MalformedHandoff),  # none
])
@pytest.mark.parametrize("decode", [lambda d: decode_handoff(_wire(d)),
                                    lambda d: decode_handoff(handoff_bytes(d))],
                         ids=["bytes", "older_frontends_message"])
def test_each_structural_rule_has_its_error(mutate, error, decode):
    d = _raw(_good())
    mutate(d)
    with pytest.raises(error):
        decode(d)


def test_version_1_stays_readable():
    """A decode tier upgraded before prefill keeps taking the older prefill's handoffs (no
    first token: decode samples it)."""
    d = _raw(_good(v=1))
    d.pop("first_token")
    h = decode_handoff(_wire(d))
    assert (h.v, h.first_token) == (1, None)
    assert decode_handoff(encode_handoff(_good(first_token=7))).first_token == 7


def test_not_a_map_is_malformed():
    with pytest.raises(MalformedHandoff):
        decode_handoff(msgspec.msgpack.encode([1, 2, 3]))
    for message in ([1, 2, 3], {"handoff": "not base64!"}, {"handoff": 3},
                    {"handoff": "", "extra": 1}):
        with pytest.raises(MalformedHandoff):
            decode_handoff(handoff_bytes(message))


def test_admission_rules():
    with pytest.raises(UnsupportedRequest):
        check_admission(_good(sampling=Sampling(prompt_logprobs=1)), fingerprint=FP)
    with pytest.raises(FingerprintMismatch):
        check_admission(_good(), fingerprint="0" * 64)
    with pytest.raises(KVRequired):
        check_admission(_good(requires_kv=False), fingerprint=FP)


def test_position_state_admission():
    """Grids exactly for a model whose positions need them (Qwen2-VL: spatial merge 2), each
    one frame whose merged size is its image's placeholder length (4 tokens here)."""
    with_grid = lambda *g: _good(features=Features(  # noqa: E731
        mm_hashes={"image": ["abc"]}, mm_placeholders={"image": [Span(offset=2, length=4)]},
        mm_grids={"image": [Grid(t=g[0], h=g[1], w=g[2])]}))
    check_admission(with_grid(1, 4, 4), fingerprint=FP, grid_rules=GridRules(2))
    check_admission(with_grid(1, 2, 8), fingerprint=FP,
                    grid_rules=GridRules(2))  # another shape, 4 tokens
    check_admission(_good(features=Features(mm_hashes={}, mm_placeholders={})), fingerprint=FP,
                    grid_rules=GridRules(2))  # text only: nothing to carry
    with pytest.raises(PositionStateMissing):
        check_admission(_good(), fingerprint=FP, grid_rules=GridRules(2))
    with pytest.raises(PositionStateUnexpected):
        check_admission(with_grid(1, 4, 4), fingerprint=FP)
    for grid in ((1, 4, 2), (1, 6, 4), (2, 4, 4), (1, 3, 4), (1, 4, 5)):
        with pytest.raises(PositionStateMismatch):
            check_admission(with_grid(*grid), fingerprint=FP, grid_rules=GridRules(2))
    with pytest.raises(DigestMismatch):  # a grid changed after prefill signed it
        signed = sign(with_grid(1, 4, 4), KEY, ttl_s=60)
        check_admission(msgspec.structs.replace(signed, features=with_grid(1, 2, 8).features),
                        fingerprint=FP, keys=[KEY], grid_rules=GridRules(2))


def _video(token_ids, span, grid):
    return _good(token_ids=token_ids, features=Features(
        mm_hashes={"video": ["vid"]}, mm_placeholders={"video": [span]},
        mm_grids={"video": [grid]}))


def test_video_position_state_admission():
    """A video's grid: `t` steps of h*w/merge^2 tokens each, exactly its span's embedded tokens;
    seconds per step required by a model that reads them (Qwen2.5-VL), refused by the others,
    and finite and positive."""
    ids = list(range(100, 116))
    span = Span(offset=2, length=8)  # two steps of 4 tokens
    qwen2, qwen25 = GridRules(2), GridRules(2, video_seconds=True)
    check_admission(_video(ids, span, Grid(t=2, h=4, w=4)), fingerprint=FP, grid_rules=qwen2)
    check_admission(_video(ids, span, Grid(t=2, h=4, w=4, seconds=1.0)), fingerprint=FP,
                    grid_rules=qwen25)
    bad = [(qwen2, Grid(t=3, h=4, w=4)), (qwen2, Grid(t=2, h=4, w=2)),  # 12, 4 tokens
           (qwen2, Grid(t=2, h=4, w=4, seconds=1.0)),  # seconds a model never reads
           (qwen25, Grid(t=2, h=4, w=4)),  # seconds missing
           *((qwen25, Grid(t=2, h=4, w=4, seconds=x))
             for x in (0.0, -1.0, float("nan"), float("inf"), 1e9))]
    for rules, grid in bad:
        with pytest.raises(PositionStateMismatch):
            check_admission(_video(ids, span, grid), fingerprint=FP, grid_rules=rules)


def test_video_frame_brackets_admission():
    """Qwen3-VL lays a video out as one bracket per step, <start> tokens <end>, each after its
    timestamp's text; vLLM searches the prompt for them, so decode admits only that layout."""
    S, E, V = 7, 8, 9
    rules = GridRules(2, frame_tokens=(S, E, V))
    steps = [[50, 51], [S], [V] * 4, [E], [52, 53], [S], [V] * 4, [E]]
    body = [t for part in steps for t in part]
    embed = [t == V for t in body]
    ids = [1, S, *body, E, 2, 3]
    span = Span(offset=2, length=len(body), is_embed=embed)
    grid = Grid(t=2, h=4, w=4)
    check_admission(_video(ids, span, grid), fingerprint=FP, grid_rules=rules)
    wrong = {
        "one bracket short": (ids, span, Grid(t=3, h=4, w=4), rules),
        "an end missing": (ids[:9] + [60] + ids[10:], span, grid, rules),
        "a video token in the text": (ids[:2] + [V] + ids[3:], span, grid, rules),
        "the marks off the video tokens": (
            ids, Span(offset=2, length=len(body), is_embed=[not e for e in embed]), grid, rules),
    }
    for name, (token_ids, s, g, r) in wrong.items():
        with pytest.raises(PositionStateMismatch):
            check_admission(_video(token_ids, s, g), fingerprint=FP, grid_rules=r)
            pytest.fail(name)


def test_an_older_handoff_carries_no_seconds():
    from mmhandoff.wire.handoff import MalformedHandoff, check_structure

    h = _video(list(range(100, 116)), Span(offset=2, length=8),
               Grid(t=2, h=4, w=4, seconds=1.0))
    check_structure(h)
    with pytest.raises(MalformedHandoff):
        check_structure(msgspec.structs.replace(h, v=7))


KEY, OLD_KEY = b"k" * 32, b"o" * 32


def test_a_signed_handoff_is_admitted_and_any_change_is_refused():
    signed = sign(_good(), KEY, ttl_s=60)
    check_admission(decode_handoff(encode_handoff(signed)), fingerprint=FP, keys=[KEY])
    changes = {
        "token ids": dict(token_ids=list(range(1, 11))),
        "an image relabelled": dict(features=Features(
            mm_hashes={"image": ["another-image"]},
            mm_placeholders=signed.features.mm_placeholders)),
        "block ids": dict(kv_transfer_params={"remote_block_ids": [9]}),
        "cache salt": dict(cache_salt="other"),
        "a later expiry": dict(expires_at=signed.expires_at + 600),
        "another nonce": dict(nonce="0" * 32),
        "block hashes": dict(block_hashes=BlockHashes(block_size=4, hashes=[1, 2])),
    }
    for name, change in changes.items():
        with pytest.raises(DigestMismatch):
            check_admission(msgspec.structs.replace(signed, **change), fingerprint=FP,
                            keys=[KEY])
    with pytest.raises(DigestMismatch):  # signed with a key decode does not have
        check_admission(sign(_good(), OLD_KEY, ttl_s=60), fingerprint=FP, keys=[KEY])


def test_authentic_is_the_signature_or_on_an_unsigned_plane_the_checksum():
    carrying = _good(block_hashes=BlockHashes(block_size=4, hashes=[1, 2]))
    signed = sign(carrying, KEY, ttl_s=60)
    assert authentic(signed, [KEY]) and authentic(signed, [OLD_KEY, KEY])
    assert not authentic(signed, [OLD_KEY])
    assert not authentic(carrying, [KEY])  # unsigned, where keys are known
    changed = msgspec.structs.replace(signed, block_hashes=BlockHashes(block_size=4,
                                                                      hashes=[1, 3]))
    assert not authentic(changed, [KEY])
    assert authentic(carrying) and authentic(sign(carrying))  # no keys: unsigned, or checksum
    assert not authentic(signed)  # a key's MAC is no checksum
    assert not authentic(msgspec.structs.replace(sign(carrying), cache_salt="x"))


def test_unsigned_expired_and_rotated_keys():
    with pytest.raises(Unsigned):
        check_admission(_good(), fingerprint=FP, keys=[KEY])
    with pytest.raises(Unsigned):  # a digest without nonce and expiry
        check_admission(sign(_good(), KEY), fingerprint=FP, keys=[KEY])
    old = sign(_good(), KEY, ttl_s=60, now=1000.0)
    check_admission(old, fingerprint=FP, keys=[KEY], now=1059.0)
    with pytest.raises(Expired):
        check_admission(old, fingerprint=FP, keys=[KEY], now=1061.0)
    # during a rotation decode takes both keys
    check_admission(sign(_good(), OLD_KEY, ttl_s=60), fingerprint=FP, keys=[KEY, OLD_KEY])
    # without keys a digest is a checksum: checked, not required
    check_admission(sign(_good()), fingerprint=FP)
    with pytest.raises(DigestMismatch):
        check_admission(msgspec.structs.replace(sign(_good()), cache_salt="x"), fingerprint=FP)


def test_a_handoff_is_single_use_and_the_guard_forgets_expired_nonces():
    guard = ReplayGuard()
    first = sign(_good(), KEY, ttl_s=10, now=1000.0)
    guard.admit(first, now=1001.0)
    with pytest.raises(Replayed):
        guard.admit(first, now=1002.0)
    guard.admit(sign(_good(), KEY, ttl_s=10, now=1000.0), now=1002.0)  # a new nonce
    assert len(guard) == 2
    guard.admit(sign(_good(), KEY, ttl_s=10, now=1020.0), now=1020.5)  # the others expired
    assert len(guard) == 1
    guard.admit(_good())  # unsigned (no keys configured): no nonce to remember
    assert len(guard) == 1


def test_repr_hides_token_ids():
    text = repr(_good(token_ids=list(range(1000, 1010))))
    assert "1005" not in text and "tokens=10" in text


def test_a_structured_answer_travels_whole():
    structured = {"json": {"type": "object", "properties": {"a": {"enum": ["x"]}}}}
    d = _raw(_good(sampling=Sampling(max_tokens=8)))
    d["sampling"]["structured"] = structured
    got = decode_handoff(_wire(d))
    assert msgspec.to_builtins(got.sampling.structured) == {
        "json": structured["json"], "json_object": False, "regex": None, "choice": None}
    assert got.sampling.whole_answer_on_one_engine()


# Sampling as version 3 of the code had it, field for field in its order (a frozen copy of
# that wire format, independent of today's Sampling).
class _SamplingV3(msgspec.Struct, kw_only=True):
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    min_tokens: int = 0
    stop: list[str] = []
    include_stop_str_in_output: bool = False


def test_a_version_3_prefills_signature_verifies_at_this_decode():
    """A decode tier upgraded before prefill (a rolling upgrade) admits the older prefill's
    signed handoffs: the MAC is computed over the message as version 3 encoded it."""
    import hashlib
    import hmac

    from mmhandoff.wire.handoff import check_admission

    key = b"k" * 32
    h = _good(v=3, sampling=Sampling(max_tokens=8, min_p=0.1, stop=["x"]), nonce="n" * 32,
              expires_at=time.time() + 30)
    old = msgspec.to_builtins(h, builtin_types=(bytes,))  # its digest still None
    old["sampling"] = msgspec.to_builtins(_SamplingV3(max_tokens=8, min_p=0.1, stop=["x"]))
    del old["features"]["mm_grids"]  # added by version 5
    del old["block_hashes"]  # added by version 6
    del old["claim"]  # added by version 7
    old["digest"] = hmac.new(key, msgspec.msgpack.encode(old), hashlib.sha256).hexdigest()
    got = decode_handoff(msgspec.msgpack.encode(old))
    check_admission(got, fingerprint=FP, keys=[key])  # verifies
    tampered = dict(old, token_ids=old["token_ids"][::-1])
    with pytest.raises(DigestMismatch):
        check_admission(decode_handoff(msgspec.msgpack.encode(tampered)), fingerprint=FP,
                        keys=[key])


def test_a_signed_handoff_verifies_as_its_readers_decode_it():
    """An int given where the type says float (temperature=0) is a float once decoded: the MAC is
    computed on the message as readers decode it, so prefill's bytes verify on every hop."""
    key = b"k" * 32
    h = sign(_good(sampling=Sampling(temperature=0, top_p=1, max_tokens=4)), key, ttl_s=30)
    received = decode_handoff(encode_handoff(h))
    assert type(received.sampling.temperature) is float
    check_admission(received, fingerprint=FP, keys=[key])


@settings(max_examples=100, deadline=None)
@given(handoffs())
def test_the_routing_view_is_the_message_without_its_token_ids_decoded(h):
    """A router reads a handoff that carries its block hashes without decoding its token ids:
    the view encodes to the very bytes it came from, so its signature verifies exactly when the
    whole message's does."""
    key = b"k" * 32
    signed = sign(msgspec.structs.replace(h, v=VERSION), key, ttl_s=30)
    wire = encode_handoff(signed)
    view = routing_view(wire)
    if signed.block_hashes is None:
        assert view is None  # nothing to route by without decoding it whole
        return
    assert msgspec.msgpack.encode(view) == wire
    assert (view.block_hashes, view.kv_transfer_params) == (signed.block_hashes,
                                                            signed.kv_transfer_params)
    assert authentic(view, [key]) and not authentic(view, [b"o" * 32])
    forged = msgspec.structs.replace(view, block_hashes=BlockHashes(block_size=1, hashes=[]))
    assert not authentic(forged, [key])
