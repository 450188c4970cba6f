"""The Handoff: what the encode/prefill worker sends to the decode tier (MessagePack, versioned).

It carries no media: only the expanded prompt token ids, one content hash and one placeholder
range per image, `requires_kv`, and the KV connector's `kv_transfer_params` that name the blocks
to pull. Decoding is strict: every malformed, truncated or forbidden message raises a subclass of
`HandoffError` with a stable `code`, never anything else.

    wire = encode_handoff(h)                     # bytes
    h = decode_handoff(wire)                     # structural rules checked
    check_admission(h, fingerprint=..., keys=..) # rules that need the decode engine's context

Integrity: with a key shared by prefill and decode, prefill signs every handoff (`sign` with a
TTL: an HMAC-SHA256 over the whole message, including a fresh nonce and an expiry), and decode
refuses one that is unsigned, signed with no key it has, tampered (an image hash relabelled,
token ids or block ids changed), expired, or seen before (`ReplayGuard`, per decode replica;
across the graph, a handoff that names KV is claimed at its prefill before the pull:
prefill.claims). Prefill's signature is what binds an image's hash to the KV the handoff names.
Expiry is prefill's wall clock against decode's: hosts must agree within the TTL (NTP does).
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import time
from dataclasses import dataclass
from typing import Annotated, Any, Sequence

import msgspec

from mmhandoff.wire import legacy
from mmhandoff.wire.errors import (  # noqa: F401  (re-exported: the errors are part of this API)
    HandoffError,
    MalformedHandoff,
    UnsupportedVersion,
    PayloadPresent,
    EmptyHash,
    FeatureMismatch,
    SpanOutOfRange,
    SpanReachesFinalToken,
    KVRequired,
    UnsupportedRequest,
    FingerprintMismatch,
    DigestMismatch,
    Unsigned,
    Expired,
    Replayed,
    ClaimFailed,
    PositionStateMissing,
    PositionStateUnexpected,
    PositionStateMismatch,
    KVMismatch,
)

# 2: `first_token`, prefill's sampled token, which the client already has; decode continues
# after it. 3: sampling's `min_p`, penalties, `min_tokens` and stop strings (SAMPLING_V3).
# 4: sampling's `structured` (structured outputs). 5: features' `mm_grids` (M-RoPE position
# state) and sampling's `logit_bias`. 6: `block_hashes`, the prompt's prefix-cache block hashes
# as prefill's engine computes them (the router looks them up instead of hashing again).
# 7: `claim`, where decode claims the handoff's KV before it pulls (single use across the graph).
# 8: video items: their grids (`mm_grids["video"]`, several frames) and a grid's `seconds`.
# Older versions (1: no first token, decode samples it) stay readable (mmhandoff.wire.legacy), so
# a decode tier upgraded first keeps taking an older prefill's handoffs; an older decode refuses a
# newer one by version.
VERSION = 8
SUPPORTED_VERSIONS = frozenset({1, 2, 3, 4, 5, 6, 7, VERSION})


# ---- wire types ---------------------------------------------------------------------------------
class _Strict(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    pass


class Span(_Strict, frozen=True):
    """Where one item's placeholder tokens sit in the prompt. `is_embed` marks, per position of
    the span, which ones receive embeddings (None: all of them)."""

    offset: int
    length: int
    is_embed: list[bool] | None = None


class BlockHashes(_Strict, frozen=True):
    """The prompt's prefix-cache block hashes as the engine computes them (vLLM's hasher with
    the engines' hash algorithm and seed), one per full block of `block_size` tokens, each as
    the KV events name it (the low 64 bits). A router with the same block size looks them up
    instead of hashing the prompt again."""

    block_size: int
    hashes: list[int]


class Claim(_Strict, frozen=True):
    """Where the handoff's KV is claimed: the prefill instance that holds it, which grants each
    handoff's nonce once (prefill.claims). Decode claims before it pulls, so a handoff's KV is
    read at most once whatever decode replica a copy reaches."""

    endpoint: str  # "<namespace>.<component>.claim"
    instance: int  # the issuing prefill's Dynamo instance id


class Grid(_Strict, frozen=True, omit_defaults=True):
    """One item's grid of vision patches as its processor computed it (frames, rows, columns
    before the spatial merge: vLLM's `image_grid_thw`, `video_grid_thw`). Numbers, not media:
    an M-RoPE model (Qwen2-VL, Qwen2.5-VL, Qwen3-VL) derives from them the positions of the
    item's tokens and so of every token after it. `seconds` (v8, videos of Qwen2.5-VL only):
    the seconds one temporal step of the grid spans (`second_per_grid_ts`), which spaces the
    frames' temporal positions."""

    t: int
    h: int
    w: int
    seconds: float | None = None


class Features(_Strict):
    """Per modality, in prompt order: one content hash and one span per item, and for models
    whose positions derive from each image's grid, one grid per item. Nothing else: any other
    field (pixels, tensors, embeddings) is a payload and is refused."""

    mm_hashes: dict[str, list[str]]
    mm_placeholders: dict[str, list[Span]]
    mm_grids: dict[str, list[Grid]] | None = None  # (v5) the position state; None: not needed

    def items(self) -> list[tuple[str, str, Span]]:
        """(modality, hash, span) for every item, sorted by position in the prompt."""
        return [item[:3] for item in self.items_with_grids()]

    def items_with_grids(self) -> list[tuple[str, str, Span, Grid | None]]:
        """(modality, hash, span, grid or None) for every item, sorted by position."""
        out = []
        grids = self.mm_grids or {}
        for modality, hashes in self.mm_hashes.items():
            spans = self.mm_placeholders.get(modality, [])
            own = grids.get(modality) or [None] * len(hashes)
            out.extend(zip([modality] * len(hashes), hashes, spans, own))
        return sorted(out, key=lambda item: item[2].offset)


class Structured(_Strict):
    """A structured-output constraint (vLLM's StructuredOutputsParams): exactly one of a JSON
    schema, any JSON object, a regular expression or a choice of strings. (Whitespace inside
    JSON is the engine's setting in vLLM 0.31, `structured_outputs_config`, not the request's.)"""

    json: dict[str, Any] | None = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None

    def __post_init__(self) -> None:
        kinds = (self.json is not None) + self.json_object + (self.regex is not None) + (
            self.choice is not None)
        if kinds != 1:
            raise ValueError("a structured-output constraint is exactly one of json, "
                             "json_object, regex, choice")


class Sampling(_Strict):
    """vLLM's sampling parameters, for the whole answer: prefill samples its first token with
    them, decode the rest (docs/api.md says where each one is applied)."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    min_p: float = 0.0  # (v3)
    seed: int | None = None
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None  # refused on decode: the prompt is not computed there
    # (v3) repetition: over the prompt and the answer; presence and frequency: over the answer's
    # tokens only
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    min_tokens: int = 0  # (v3) stop tokens are masked until the answer has this many
    stop: list[str] = []  # (v3) stop strings
    include_stop_str_in_output: bool = False  # (v3)
    structured: Structured | None = None  # (v4) the answer follows this constraint
    # (v5) added to the logits of these token ids (OpenAI's form: decimal id strings, so the map
    # survives JSON), at every token: prefill's and decode's alike
    logit_bias: dict[str, float] | None = None

    def whole_answer_on_one_engine(self) -> bool:
        """Whether one engine must sample every token of the answer, so that decode samples the
        first too: presence and frequency penalties count an engine's own output only; with
        stop strings vLLM holds back text that may start one, which prefill's token, streamed
        at once, cannot be; a structured-output grammar advances over an engine's own output,
        so decode's would start again at prefill's token."""
        return bool(self.presence_penalty or self.frequency_penalty or self.stop
                    or self.structured)


_DEFAULT_SAMPLING = Sampling()


class Handoff(_Strict):
    v: int
    request_id: str
    model_fingerprint: str
    token_ids: list[Annotated[int, msgspec.Meta(ge=0)]]  # the decoder refuses a negative id
    features: Features
    requires_kv: bool
    kv_transfer_params: dict[str, Any]
    sampling: Sampling
    cache_salt: str | None = None
    # The last `continued` token ids are an answer's tokens already streamed (a migrated
    # request): decode's text goes on from theirs.
    continued: int = 0
    # (v2) The answer's first token, sampled by prefill and already sent to the client: decode's
    # prompt is `token_ids` + this token, it pulls the KV of `token_ids` and generates the
    # answer's tokens from the second on (`sampling.max_tokens` counts the whole answer). None:
    # decode samples the first token (v1; the router's prefill bypass).
    first_token: int | None = None
    nonce: str | None = None  # set by `sign` with a TTL: makes the handoff single use
    expires_at: float | None = None  # unix seconds, prefill's clock
    digest: str | None = None  # hex HMAC-SHA256 over the message without it (see `sign`)
    # (v6) The hashes of `token_ids`' full blocks, as prefill's engine computes them: a hint for
    # routers, used only when the handoff is authentic. Decode's engine hashes for itself.
    block_hashes: BlockHashes | None = None
    # (v7) Where decode claims the KV before pulling it; None: no KV, or a prefill that
    # records no claims (in-process), whose handoffs are single use per decode replica only.
    claim: Claim | None = None

    def __repr__(self) -> str:  # never dump token ids or transfer params into logs
        counts = {m: len(h) for m, h in self.features.mm_hashes.items()}
        return (f"Handoff(v={self.v}, request_id={self.request_id!r}, "
                f"tokens={len(self.token_ids)}, items={counts}, requires_kv={self.requires_kv})")

    def items(self) -> list[tuple[str, str, Span]]:
        """(modality, hash, span) for every item, sorted by position in the prompt."""
        return self.features.items()

    def items_with_grids(self) -> list[tuple[str, str, Span, Grid | None]]:
        """(modality, hash, span, grid or None) for every item, sorted by position."""
        return self.features.items_with_grids()


class _Envelope(msgspec.Struct):
    v: Any = None


# The Handoff with its token ids kept as they came (msgspec.Raw, not decoded into ints): the same
# fields in the same order, so encoding it gives the bytes it was decoded from.
RoutingView = msgspec.defstruct(
    "RoutingView",
    [(f.name, msgspec.Raw if f.name == "token_ids" else f.type,
      *(() if f.default is msgspec.NODEFAULT else (f.default,)))
     for f in msgspec.structs.fields(Handoff)],
    kw_only=True, forbid_unknown_fields=True, module=__name__)

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Handoff)
_envelope_decoder = msgspec.msgpack.Decoder(_Envelope)
_view_decoder = msgspec.msgpack.Decoder(RoutingView)

# Field names under `features` that would carry media; all unknown fields are refused, these get
# the more precise error.
_PAYLOAD_HINTS = ("mm_kwargs", "kwargs", "data", "pixel", "embed", "tensor", "image", "payload")


# ---- encode / decode ----------------------------------------------------------------------------
def encode_handoff(handoff: Handoff) -> bytes:
    return _encoder.encode(handoff)


def decode_handoff(data: bytes) -> Handoff:
    """Decode and check the structural rules; raise a `HandoffError` for anything else."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise MalformedHandoff(f"expected bytes, got {type(data).__name__}")
    try:
        handoff = _decoder.decode(data)  # one pass in the common case
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise _refusal(data, e) from None
    _check_version(handoff.v)
    check_structure(handoff)
    return handoff


def routing_view(data: bytes) -> Any | None:
    """What a router reads of a current handoff that carries its block hashes, without decoding
    its token ids (most of the message's decoding time): a RoutingView whose `authentic` is the
    full message's (its encoding is the bytes it came as). None for anything else (an older
    version, no block hashes, not a handoff): decode it whole. Not checked beyond its types:
    only for a hint; decode checks the handoff itself."""
    try:
        view = _view_decoder.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None
    return view if view.v == VERSION and view.block_hashes is not None else None


def _check_version(version: Any) -> None:
    # `v` may decode to anything (a map, a list: unhashable); only an int names a version
    if type(version) is not int or version not in SUPPORTED_VERSIONS:
        raise UnsupportedVersion(f"handoff version {version!r} is not supported (supported: "
                                 f"{sorted(SUPPORTED_VERSIONS)})")


def _refusal(data: bytes, e: Exception) -> HandoffError:
    """The error for a message the typed decoder refused: its version first (a newer handoff's
    new fields are not malformed, they are another version's), then what was wrong."""
    try:
        _check_version(_envelope_decoder.decode(data).v)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return MalformedHandoff(f"not a handoff message: {e}")
    except UnsupportedVersion as refused:
        return refused
    msg = str(e)
    if not isinstance(e, msgspec.ValidationError):  # (a DecodeError, of which it is a kind)
        return MalformedHandoff(f"not a handoff message: {msg}")
    if "unknown field" in msg and "$.features" in msg:
        if any(hint in msg.lower() for hint in _PAYLOAD_HINTS):
            return PayloadPresent(f"the handoff must carry no media payload: {msg}")
        return PayloadPresent(f"features may hold only hashes, placeholders and grids: {msg}")
    return MalformedHandoff(msg)


def check_structure(h: Handoff) -> None:
    """Rules that need nothing but the message itself."""
    n = len(h.token_ids)
    if not h.request_id:
        raise MalformedHandoff("request_id is empty")
    if n == 0:
        raise MalformedHandoff("token_ids is empty")
    hashes, spans = h.features.mm_hashes, h.features.mm_placeholders
    if set(hashes) != set(spans):
        raise FeatureMismatch(
            f"modalities differ between hashes {sorted(hashes)} and placeholders {sorted(spans)}")
    for modality in hashes:
        if len(hashes[modality]) != len(spans[modality]):
            raise FeatureMismatch(
                f"{modality}: {len(hashes[modality])} hashes but {len(spans[modality])} spans")
    for modality, grids in (h.features.mm_grids or {}).items():
        if len(grids) != len(hashes.get(modality, ())):
            raise PositionStateMismatch(
                f"{modality}: {len(grids)} grids for {len(hashes.get(modality, ()))} items")
        if any(min(g.t, g.h, g.w) < 1 for g in grids):
            raise PositionStateMismatch(f"{modality}: a grid with a size below 1")
    end_prev = 0
    for modality, digest, span in h.items():
        if not digest:
            raise EmptyHash(f"a {modality} item has an empty content hash")
        if span.length <= 0 or span.offset < 0 or span.offset + span.length > n:
            raise SpanOutOfRange(
                f"{modality} span [{span.offset}, {span.offset + span.length}) is not inside the "
                f"{n}-token prompt")
        if span.offset + span.length >= n:
            raise SpanReachesFinalToken(
                f"{modality} span [{span.offset}, {span.offset + span.length}) reaches the final "
                f"prompt token {n - 1}, which decode always recomputes")
        if span.offset < end_prev:
            raise SpanOutOfRange(f"{modality} span at {span.offset} overlaps the previous item")
        if span.is_embed is not None and len(span.is_embed) != span.length:
            raise SpanOutOfRange(f"{modality} span's is_embed has {len(span.is_embed)} entries, "
                                 f"expected {span.length}")
        end_prev = span.offset + span.length
    if h.sampling.max_tokens < 1:
        raise MalformedHandoff("sampling.max_tokens must be at least 1")
    if not 0 <= h.sampling.min_tokens <= h.sampling.max_tokens:
        raise MalformedHandoff("sampling.min_tokens must be in [0, max_tokens]")
    if h.v < VERSION:
        legacy.check_older(h, _DEFAULT_SAMPLING)
    if h.block_hashes is not None:
        size, hashes = h.block_hashes.block_size, h.block_hashes.hashes
        if size < 1 or len(hashes) != n // size:
            raise MalformedHandoff(f"{len(hashes)} block hashes of {size} tokens for a "
                                   f"{n}-token prompt: expected one per full block")
    if h.claim is not None and not h.requires_kv:
        raise MalformedHandoff("a claim is of KV: this handoff names none to pull")
    if h.sampling.structured is not None:
        if h.first_token is not None or h.continued:
            # the grammar starts at decode's first output token: tokens already in the prompt
            # (prefill's, or a migrated answer's) would not be in it
            raise MalformedHandoff("a structured answer is sampled wholly by decode: no "
                                   "first_token, nothing continued")
    if h.first_token is not None:
        if h.v < 2:
            raise MalformedHandoff("first_token needs handoff version 2")
        if h.first_token < 0:
            raise MalformedHandoff("first_token is a negative id")
        if h.sampling.max_tokens < 2:  # an answer of one token ends at prefill
            raise MalformedHandoff("a handoff with first_token must leave decode a token to "
                                   "generate (sampling.max_tokens >= 2)")
    if not 0 <= h.continued < n:
        raise MalformedHandoff(f"continued ({h.continued}) must be in [0, {n}): the prompt "
                               "before the answer's tokens cannot be empty")


def check_admission(h: Handoff, *, fingerprint: str, keys: Sequence[bytes] = (),
                    now: float | None = None, grid_rules: GridRules | None = None) -> None:
    """The decode-side rules that need the engine's context: its model fingerprint, the keys
    a handoff may be signed with (several during a key rotation; none: unsigned handoffs are
    taken, and a digest, if any, is checked as a checksum), and whether its model derives
    positions from each item's grid (`grid_rules`; None: no position state)."""
    check_position_state(h, grid_rules)
    if h.sampling.prompt_logprobs is not None:
        raise UnsupportedRequest("prompt logprobs need the prompt computed; decode does not")
    if h.features.mm_hashes and not h.requires_kv:
        raise KVRequired("a handoff with media must set requires_kv: decode never sees media")
    if h.model_fingerprint != fingerprint:
        raise FingerprintMismatch(
            f"handoff is for model {h.model_fingerprint[:16]}..., this engine serves "
            f"{fingerprint[:16]}...")
    if keys:
        if h.digest is None:
            raise Unsigned("handoff is not signed; this decode takes signed handoffs only")
        if not authentic(h, keys):
            raise DigestMismatch("handoff digest does not verify with any of decode's keys")
        if h.nonce is None or h.expires_at is None:
            raise Unsigned("a signed handoff needs a nonce and an expiry")
        if (time.time() if now is None else now) > h.expires_at:
            raise Expired("handoff expired before decode got it")
    elif not authentic(h):
        raise DigestMismatch("handoff checksum does not verify")
    if h.claim is not None and h.nonce is None:  # (with keys, refused above as unsigned)
        raise MalformedHandoff("a claim is of a signed handoff's nonce: this one has none")


def authentic(h: Handoff, keys: Sequence[bytes] = ()) -> bool:
    """Whether `h` is as its prefill sent it: its digest verifies with one of `keys`; with no
    keys (an unsigned plane), it is unsigned or its checksum verifies."""
    if not keys:
        return h.digest is None or hmac.compare_digest(h.digest, _mac(h, b""))
    return h.digest is not None and any(hmac.compare_digest(h.digest, _mac(h, key))
                                        for key in keys)


@dataclass(frozen=True)
class GridRules:
    """What a decode engine whose positions derive from each item's grid takes (from its model's
    config: vllm_adapter.positions.grid_rules)."""

    merge: int  # rows (and columns) of patches merged into one token
    # videos: each grid's `seconds` is required (Qwen2.5-VL's second_per_grid_ts), else refused
    video_seconds: bool = False
    # videos: each temporal step is its own bracket in the prompt, <start> video tokens <end>,
    # after its timestamp's text (Qwen3-VL); the (start, end, video) token ids. None: a video's
    # tokens are one run of its span.
    frame_tokens: tuple[int, int, int] | None = None


MAX_GRID_SECONDS = 3600.0  # one temporal step of an hour: anything above is not a video's


def check_position_state(h: Handoff, rules: GridRules | None) -> None:
    """Grids exactly for a model that needs them, one per item, each consistent with its
    placeholder: an image one frame whose merged size is its span's length; a video `t` steps
    of that many tokens each, laid out as the model lays them (`rules`). vLLM's M-RoPE
    code asserts these (and Qwen3-VL's searches the prompt's tokens for each frame): a grid
    that disagrees would stop the engine, not fail the request."""
    grids = {m: g for m, g in (h.features.mm_grids or {}).items() if g}
    if rules is None:
        if grids:
            raise PositionStateUnexpected("the handoff carries grids; this model's positions "
                                          "do not depend on them")
        return
    merge = rules.merge
    for modality, digest, span, grid in h.items_with_grids():
        if grid is None:
            raise PositionStateMissing(f"this model derives positions from each item's grid; "
                                       f"the handoff has none for {modality} {digest[:16]}")
        shape = f"{modality} grid {grid.t}x{grid.h}x{grid.w}"
        if modality not in ("image", "video") or modality == "image" and grid.t != 1:
            raise PositionStateMismatch(f"{shape}: only images of one frame and videos are "
                                        "taken")
        if grid.h % merge or grid.w % merge:
            raise PositionStateMismatch(f"{shape} is not a multiple of the model's "
                                        f"{merge}x{merge} merge")
        seconds = grid.seconds
        wanted = modality == "video" and rules.video_seconds
        if (seconds is not None) != wanted:
            raise PositionStateMismatch(
                f"{shape}: {'no' if seconds is None else 'a'} seconds per step; this model "
                f"{'needs them' if wanted else 'takes none'} for its {modality}s")
        if seconds is not None and not 0 < seconds <= MAX_GRID_SECONDS:  # NaN fails too
            raise PositionStateMismatch(f"{shape}: {seconds} seconds per step is not in "
                                        f"(0, {MAX_GRID_SECONDS:g}]")
        per_step = grid.h * grid.w // merge ** 2
        if modality == "video" and rules.frame_tokens is not None:  # text between the frames
            _check_frames(h.token_ids, span, grid.t, per_step, rules.frame_tokens, shape)
        elif grid.t * per_step != span.length:
            raise PositionStateMismatch(f"{shape} makes {grid.t * per_step} tokens; its "
                                        f"placeholder has {span.length}")


def _check_frames(token_ids: Sequence[int], span: Span, steps: int, per_step: int,
                  frame_tokens: tuple[int, int, int], shape: str) -> None:
    """A Qwen3-VL video's span: `steps` brackets <start> `per_step` video tokens <end>, each
    after its timestamp's text, and the video tokens exactly the embedded positions."""
    start, end, video = frame_tokens
    tokens = token_ids[span.offset:span.offset + span.length]
    embed = span.is_embed or [True] * span.length
    brackets, i = 0, 0
    while i < len(tokens):
        if tokens[i] in (end, video) or embed[i]:
            break  # a video token or an end outside a bracket
        if tokens[i] != start:
            i += 1  # the timestamp's text
            continue
        run = tokens[i + 1:i + 1 + per_step]
        closed = i + 1 + per_step < len(tokens) and tokens[i + 1 + per_step] == end
        if (not closed or run.count(video) != per_step
                or not all(embed[i + 1:i + 1 + per_step]) or embed[i] or embed[i + 1 + per_step]):
            break
        brackets, i = brackets + 1, i + 2 + per_step
    else:
        if brackets == steps:
            return
    raise PositionStateMismatch(f"{shape}: its placeholder is not {steps} frames of "
                                f"<start> {per_step} video tokens <end>")


def sign(h: Handoff, key: bytes = b"", *, ttl_s: float | None = None,
         now: float | None = None) -> Handoff:
    """Return `h` with its digest set (HMAC-SHA256 with `key`; an empty key is a checksum).
    With `ttl_s`, it also gets a fresh nonce and expires `ttl_s` from `now`."""
    # what every reader will decode (an int given for a float field arrives as a float): the MAC
    # is checked on the decoded message, so it is computed on the same
    h = _decoder.decode(_encoder.encode(h))
    if ttl_s is not None:
        h = msgspec.structs.replace(h, nonce=secrets.token_hex(16),
                                    expires_at=(time.time() if now is None else now) + ttl_s)
    return msgspec.structs.replace(h, digest=_mac(h, key))


class ReplayGuard:
    """The nonces of admitted handoffs until they expire: a handoff is admitted once. Memory is
    bounded by the rate of handoffs times their TTL."""

    def __init__(self) -> None:
        self._seen: dict[str, float] = {}  # nonce -> expires_at, in admission order
        self._next_prune = 0.0

    def admit(self, h: Handoff, now: float | None = None) -> None:
        if h.nonce is None or h.expires_at is None:
            return  # unsigned handoffs (no keys configured) carry no nonce
        now = time.time() if now is None else now
        if now >= self._next_prune:  # at most once a second
            self._seen = {n: t for n, t in self._seen.items() if t >= now}
            self._next_prune = now + 1.0
        if h.nonce in self._seen:
            raise Replayed(f"handoff {h.request_id!r} was already admitted (a handoff is single "
                           "use)")
        self._seen[h.nonce] = h.expires_at

    def __len__(self) -> int:
        return len(self._seen)


def _mac(h: Handoff, key: bytes) -> str:
    unsigned = msgspec.structs.replace(h, digest=None)
    body = legacy.signed_body(unsigned) if h.v < VERSION else None
    return hmac.new(key, body or _encoder.encode(unsigned), hashlib.sha256).hexdigest()
