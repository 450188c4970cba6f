"""Wire types between components, besides the Handoff itself (mmhandoff.wire.handoff)."""

from __future__ import annotations

from typing import Any, Literal

import msgspec

from mmhandoff.wire import legacy
from mmhandoff.wire.handoff import MalformedHandoff, Sampling


class TextPart(msgspec.Struct, tag_field="type", tag="text", forbid_unknown_fields=True):
    text: str


class ImageURL(msgspec.Struct, forbid_unknown_fields=True):
    url: str


class ImagePart(msgspec.Struct, tag_field="type", tag="image_url", forbid_unknown_fields=True):
    """An image, in OpenAI's form. Between components `url` is always a data URI (the frontend
    fetched and checked it); in-process callers may also name a local file."""

    image_url: ImageURL


class VideoURL(msgspec.Struct, forbid_unknown_fields=True):
    url: str


class VideoPart(msgspec.Struct, tag_field="type", tag="video_url", forbid_unknown_fields=True):
    """A video, in vLLM's form (OpenAI's API has none). Between components `url` is always a
    data URI (the frontend fetched and checked it)."""

    video_url: VideoURL


MediaPart = ImagePart | VideoPart


def media_url(part: MediaPart) -> str:
    return part.image_url.url if isinstance(part, ImagePart) else part.video_url.url


class ChatMessage(msgspec.Struct, forbid_unknown_fields=True):
    role: Literal["system", "user", "assistant"]
    content: str | list[TextPart | ImagePart | VideoPart]

    def parts(self) -> list[TextPart | ImagePart | VideoPart]:
        return [TextPart(self.content)] if isinstance(self.content, str) else self.content


def user(text: str, *image_urls: str) -> ChatMessage:
    """A user turn: the images first, then the text (the order the tiny LLaVA template expects)."""
    return ChatMessage("user", [*(ImagePart(ImageURL(u)) for u in image_urls), TextPart(text)])


class PrefillRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Chat messages (parsed once, at the frontend), or (completions) a raw `prompt` with no chat
    template and no images. `continuation`: the answer's tokens already sent, when a request
    migrates after its decode replica was lost; they follow the rendered prompt, and `sampling`
    then asks only for the rest."""

    request_id: str
    messages: list[ChatMessage] = msgspec.field(default_factory=list)
    prompt: str | None = None
    sampling: Sampling = msgspec.field(default_factory=Sampling)
    cache_salt: str | None = None
    continuation: list[int] = msgspec.field(default_factory=list)
    # Prefill's sampled token is the answer's first (streamed at once; decode continues after
    # it). False: the older contract, decode samples it (benchmarks compare the two).
    first_token: bool = True
    # Prefill may skip its engine when a decode replica already holds the prompt's KV (the
    # router's bypass, docs/routing.md). False: the frontend's retry after such a handoff failed.
    allow_bypass: bool = True
    # the prompt's log probabilities with this many top tokens each (completions' echo with
    # logprobs): computed by the engine that computes the prompt (prefill, or agg)
    prompt_logprobs: int | None = None
    # one per image or video, naming its prefix (frontend.placement.image_keys), in a graph with
    # a router:
    # prefill publishes which of its engine's blocks each stands for, for the router's placement
    image_keys: list[str] = []

    def __post_init__(self) -> None:
        if (self.prompt is None) == (not self.messages):
            raise ValueError("a prefill request has messages or a prompt: exactly one")

    def image_urls(self) -> list[str]:
        return [p.image_url.url for m in self.messages for p in m.parts()
                if isinstance(p, ImagePart)]

    def media(self) -> list[ImagePart | VideoPart]:
        """The request's images and videos, in prompt order."""
        return [p for m in self.messages for p in m.parts() if isinstance(p, MediaPart)]


class PrefillStats(msgspec.Struct, kw_only=True):
    images: int
    image_bytes: int
    prompt_tokens: int
    prepare_ms: float  # image decode + hashing + rendering
    media_ms: float = -1.0  # of prepare_ms, the image decode + hashing (+ presize)
    prefill_ms: float
    # the handoff names no KV to pull: decode's prefix cache holds the prompt through its last
    # image, and prefill's engine never saw the request (docs/routing.md, "Prefill bypass")
    bypassed: bool = False
    # prompt tokens prefill's engine found in its own prefix cache (vLLM's count; -1: unknown)
    cached_tokens: int = -1
    videos: int = 0  # (images and image_bytes count images only)
    video_bytes: int = 0


class FullMediaRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """The benchmark arm "decode receives the media": the rendered prompt text and the original
    image (and video) bytes go to decode, which decodes and re-processes them (what P/D stacks
    do today; Dynamo's vLLM P/D for video)."""

    request_id: str
    prompt: str
    images: list[bytes]
    kv_transfer_params: dict[str, Any]
    sampling: Sampling
    videos: list[bytes] = []


class TopLogprob(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    token_id: int
    token: str  # the token's text, as vLLM's detokenizer gives it
    logprob: float


class TokenLogprob(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """A sampled token's log probability and, when asked (`Sampling.logprobs` = k > 0), the k
    most likely tokens at its position, most likely first (vLLM's ranks)."""

    token_id: int
    token: str
    logprob: float
    top: list[TopLogprob] = []


class PromptLogprobs(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """The prompt's tokens with their log probabilities (completions' `echo` with `logprobs`):
    the first token has none (nothing precedes it), each later one its TokenLogprob."""

    first_token_id: int
    first_token: str
    rest: list[TokenLogprob] = []


class FirstToken(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """The answer's first token, sampled by prefill. `finish_reason` set: the answer ends with it
    (a stop token, or `max_tokens` 1) and nothing goes to decode. `logprob`: when the request
    asked for log probabilities."""

    token_id: int
    text: str
    finish_reason: str | None = None
    logprob: TokenLogprob | None = None


class PrefillAnswer(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """What prefill.generate answers: the answer's first token (unless the request asked decode
    to sample it), the message for decode (exactly one of them, none when the answer ended at
    the first token) and prefill's statistics. `handoff` is the Handoff as prefill encoded and
    signed it (mmhandoff.wire.handoff.encode_handoff): it travels to decode as these bytes, which
    the frontend never decodes. `full_media` is the benchmark arm in which decode gets the media
    again."""

    first: FirstToken | None = None
    handoff: bytes | None = None
    full_media: FullMediaRequest | None = None
    stats: PrefillStats
    prompt_logprobs: PromptLogprobs | None = None  # when the request asked

    def __post_init__(self) -> None:
        ended = self.first is not None and self.first.finish_reason is not None
        messages = (self.handoff is not None) + (self.full_media is not None)
        if messages != (0 if ended else 1):
            raise ValueError("a prefill answer carries exactly one of handoff, full_media, or "
                             "none once the answer ended at its first token")

    def needs_decode(self) -> bool:
        return self.handoff is not None or self.full_media is not None

    def for_decode(self) -> dict[str, Any]:
        """The message for decode (through the router, if any), in the builtin form the Dynamo
        endpoint carries."""
        if self.handoff is not None:
            return msgspec.to_builtins(HandoffMessage(handoff=self.handoff))
        return msgspec.to_builtins(self.full_media)


class HandoffMessage(msgspec.Struct, forbid_unknown_fields=True):
    """What decode's and the router's endpoints take (the router's `held` lookup too): the
    handoff's bytes as prefill signed them, unchanged on every hop (base64 text in the JSON
    Dynamo carries). Whoever needs its fields decodes them, strictly, from these bytes
    (`handoff_bytes`, then mmhandoff.wire.handoff.decode_handoff); nobody encodes it again."""

    handoff: bytes


def handoff_bytes(message: Any) -> bytes:
    """The handoff's bytes in an endpoint's message (a HandoffMessage in builtin form). A map
    without `handoff` is the form older frontends send (the Handoff's own fields): it is encoded
    here (mmhandoff.wire.legacy) and decoding it gives the Handoff's own errors. Anything else
    raises MalformedHandoff."""
    if isinstance(message, dict) and "handoff" not in message:
        return legacy.encode_builtin_handoff(message)
    try:
        return msgspec.convert(message, HandoffMessage).handoff
    except msgspec.ValidationError as e:
        raise MalformedHandoff(f"not a handoff message: {e}") from None


class ClaimRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """What decode asks the prefill instance a handoff names (`Handoff.claim`) before it pulls
    the KV: that handoff's nonce, granted once (prefill.claims)."""

    nonce: str
    request_id: str  # for the logs


class Claimed(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """The claim's grant (a refusal is an error envelope: `replayed`, `expired`)."""

    request_id: str


class DecodeStats(msgspec.Struct, kw_only=True):
    request_bytes: int  # what decode received
    prompt_tokens: int = -1
    prepare_ms: float  # decode-side input preparation before the engine got the request
    # of prepare_ms, loading the images and videos (agg: decode, hash, presize; -1: none here)
    media_ms: float = -1.0
    kv_tokens_local: int = -1  # prompt tokens found in decode's own prefix cache
    kv_tokens_pulled: int = -1  # prompt tokens pulled from prefill over NIXL
    kv_positions_covered: int = -1  # prompt positions served from KV at first compute
    ttft_ms: float = 0.0  # decode's first token (the answer's second when prefill sent one)
    admitted_at: float = 0.0  # unix time decode admitted the request (0: no decode)


class DecodeChunk(msgspec.Struct, kw_only=True):
    """One streamed piece of a decode answer; the last one has `finish_reason` and `stats`.
    `logprobs`: one per token id, when the request asked for log probabilities."""

    request_id: str
    token_ids: list[int]
    text: str
    finish_reason: str | None = None
    stats: DecodeStats | None = None
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: PromptLogprobs | None = None  # agg's first chunk, when the request asked


class AnswerStats(DecodeStats, kw_only=True):
    """The public `mmhandoff` object of an answer: the last decode's statistics, prefill's, how
    many times the request went through prefill again before decode streamed (decode failed
    closed, a worker was lost), and how many times it continued elsewhere after a decode
    replica was lost mid-answer."""

    prefill: PrefillStats | None = None
    retries: int = 0
    migrations: int = 0
    # unix time the frontend had delivered the first token (written to the client's stream)
    # and asked for the rest
    first_token_at: float = 0.0


class RemoteFault(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """A refusal or failure of another component. `fault` says whose: "client" (the request as
    the client sent it: a 4xx at the frontend) or "server" (ours: a 5xx)."""

    code: str
    message: str
    cause: str | None = None
    fault: Literal["client", "server"] = "server"


class ErrorEnvelope(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """How an endpoint reports a typed error in its stream (Dynamo would flatten an exception
    into the text of a ValueError)."""

    error: RemoteFault


class KvBlocks(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, omit_defaults=True):
    """One item of a worker's `kv_blocks` stream (mmhandoff.process.block_feed): the first is the
    whole picture (`snapshot`: every block its engine holds now, its load and its latest image
    prefixes), each later one a change, in the engine's order: blocks `stored`, blocks `removed`,
    or every block gone (`cleared`, an engine that reset its prefix cache), and between them the
    engine's `load` when it changes and (prefill) the blocks of image `prefixes` it computed.
    Hashes are the engine's own, as its KV events give them."""

    kind: Literal["snapshot", "stored", "removed", "cleared", "load", "prefixes"]
    hashes: list[int | bytes] = []
    block_size: int = 0  # in a snapshot: the engine's, which a router must hash with
    # in a snapshot, and kind "load" on every change: the engine's requests running and waiting
    # as of its last step, and the share of its KV cache they hold: what routers balance by
    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0
    # in a snapshot (the latest ones), and kind "prefixes" for each request with image keys
    # (prefill workers): image key -> the engine's hashes of the full blocks through that image
    prefixes: dict[str, list[int | bytes]] = {}


class KvHeld(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """What router.held answers for a prompt (sent as a handoff that names no KV): the live
    decode instance holding most of its leading blocks (None: none holds any), how many it
    holds, and the prompt's full blocks."""

    instance: int | None = None
    blocks_held: int = 0
    blocks: int = 0


class PlaceRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """What the frontend asks router.place before prefill: which prefill replica should take a
    request. `image_keys`: one per image in prompt order, each identifying everything the
    rendered prompt holds up to that image's end (frontend.placement.image_keys)."""

    request_id: str
    image_keys: list[str] = []


class Placement(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """router.place's answer: the prefill instance to send the request to (None: any, Dynamo's
    round robin), why (`overlap`: it holds the blocks of the request's longest known image
    prefix; `load`: nothing known is held anywhere; `round_robin`; `random`: that policy), and
    its overlap."""

    instance: int | None = None
    reason: str = "round_robin"
    blocks_held: int = 0
    blocks: int = 0


class Alive(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """What a component's `alive` endpoint answers (the frontend's: it has no other endpoint by
    which discovery can see it)."""

    alive: bool = True
