"""The engine interface the workers use. mmhandoff.vllm_adapter implements it with vLLM;
mmhandoff.engine.fake implements it with a deterministic stand-in for the fast tests. What the
workers share around it: a request's render (engine.prompt: prefill and agg) and an engine
request's steps as the chunks a caller streams (engine.stream: decode, agg, the full-media arm).

Lifecycle of an engine: started by its implementation (`vllm_adapter.start_engine(spec)`), then any
number of concurrent requests, then `shutdown()`. While it serves, `dead_cause()` says why it can
serve no more (None while it can). One request:

    prompt = engine.chat_prompt(conversation)            # the model's chat template, as text
    rendered = await engine.render(prompt, media)        # token ids; one hash + span per item
    engine.discard(rendered)                             # (or: a render never submitted)
    request = engine.request(rendered, sampling)         # or: await engine.kv_only(handoff, id)
    async for step in engine.generate(request, id): ...  # typed steps, the last one finished
    await engine.abort(id)                               # frees its blocks; no-op once finished

Closing the `generate` iterator early need not abort the request: a caller that stops early
calls `abort`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Protocol, Sequence

from mmhandoff.media.images import LoadedImage
from mmhandoff.media.videos import LoadedVideo
from mmhandoff.wire.handoff import Features, GridRules, Handoff, Sampling
from mmhandoff.wire.messages import PromptLogprobs, TokenLogprob


# In a prefill request's kv_transfer_params (with "do_remote_decode"): if its token stops the
# answer, the engine frees the blocks at once and names none (no decode will pull them).
RELEASE_ON_STOP_KEY = "mmhandoff_release_on_stop"


class PixelsNeeded(Exception):
    """`render` was given an item without its data (`LoadedImage.image` or `LoadedVideo.video`
    None) that the engine's cache of processed items does not hold: decode it, render again."""


class EngineInputError(ValueError):
    """The engine refuses a request as given (e.g. longer than the model's context): the
    client's fault when the request came from a client."""

    code = "invalid_request"
    fault = "client"


@dataclass(frozen=True)
class Capabilities:
    """What a KV-only decode depends on."""

    mrope: bool = False  # positions are M-RoPE's (Qwen-VL)
    # M-RoPE from each item's grid alone (Qwen2-VL, Qwen2.5-VL, Qwen3-VL): the handoff carries
    # the grids, and decode admits them by these rules. None: no such position state.
    grid_rules: GridRules | None = None
    encoder_decoder: bool = False  # decode would need the encoder's output
    vision: bool = True  # the engine built its vision tower (a KV-only decode engine has none)


@dataclass
class Rendered:
    """A prompt as the engine will run it."""

    token_ids: list[int]
    features: Features  # one content hash and one placeholder span per image or video
    engine_input: Any  # the implementation's own form, handed back to `request`
    # images this render recorded as sent to the engine (vLLM: its processor cache's mirror):
    # `discard` forgets them when the prompt is never submitted
    first_sent: tuple[str, ...] = ()


@dataclass
class Step:
    """What one engine step adds to a request's output."""

    token_ids: list[int]  # new since the previous step
    text: str  # new text since the previous step
    finish_reason: str | None = None  # set on the last step only
    prompt_tokens: int = 0
    logprobs: list[TokenLogprob] | None = None  # one per token id, when the sampling asks
    # last step only:
    kv_transfer_params: dict[str, Any] | None = None  # prefill: the blocks decode will pull
    kv_failure: str | None = None  # a KV-only request whose KV did not cover the images: why
    kv_stats: dict[str, int] = field(default_factory=dict)  # prompt tokens: local/external/covered
    cached_tokens: int = -1  # prompt tokens found in the engine's own prefix cache (-1: unknown)
    prompt_logprobs: PromptLogprobs | None = None  # first step only, when the request asked

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class Engine(Protocol):
    fingerprint: str  # identity of what it computes: prefill's and decode's must be equal
    capabilities: Capabilities
    block_size: int  # tokens per KV block

    def chat_prompt(self, conversation: list[dict[str, Any]]) -> str:
        """The chat template applied to messages whose image parts are `{"type": "image"}`."""
        ...

    async def render(self, prompt: str, media: Sequence[LoadedImage | LoadedVideo]) -> Rendered:
        """Tokenize `prompt` and expand its image and video placeholders (`media` in prompt
        order); each item's identity is its content hash. An item without its data is taken
        from the engine's cache of processed items; PixelsNeeded if it is not there."""
        ...

    def presizer(self) -> Any:
        """A picklable callable that brings an image to the size the engine's image processor
        resizes it to, with the model's input unchanged (media.presize), checked once here; None
        where the engine has none or its exactness is not known."""
        ...

    def load_video(self, data_uri: str) -> tuple[Any, dict[str, Any]]:
        """A video's frames sampled as the engine's own server samples them for its model, and
        their metadata; a ValueError for data it cannot read."""
        ...

    def request(self, rendered: Rendered, sampling: Sampling, *, max_tokens: int | None = None,
                kv_transfer_params: dict[str, Any] | None = None,
                cache_salt: str | None = None, continued: int = 0,
                prompt_logprobs: int | None = None) -> Any:
        """A request for `rendered` (prefill, agg, and the full-media arm). `cache_salt` goes
        into its blocks' hashes, as it does on decode (`kv_only`): prefix-cache isolation, and
        the same hashes on both engines. `continued`: the prompt's last tokens are an answer's
        already sent (`extend`); the text streamed goes on from theirs. `prompt_logprobs`: the
        first step carries the prompt's log probabilities, with this many top tokens each."""
        ...

    def block_hashes(self, rendered: Rendered, cache_salt: str | None, upto: int) -> list:
        """The hashes this engine gives the full blocks of `rendered`'s first `upto` tokens, in
        the form its KV events carry (what routers index)."""
        ...

    def discard(self, rendered: Rendered) -> None:
        """`rendered` will not be submitted (prefill's bypass): undo what rendering it recorded,
        so that the next request with its images sends them to the engine."""
        ...

    def extend(self, rendered: Rendered, token_ids: list[int]) -> Rendered:
        """`rendered` followed by `token_ids`: the prompt of an answer that continues from the
        tokens already sent (a migrated request). The images keep their spans."""
        ...

    async def kv_only(self, handoff: Handoff, request_id: str) -> Any:
        """A request that computes nothing the handoff's KV covers and has no media; with the
        handoff's `first_token`, it continues after that token. Raises EngineInputError when the
        engine's own input checks refuse it."""
        ...

    def generate(self, request: Any, request_id: str) -> AsyncIterator[Step]:
        ...

    async def abort(self, request_id: str) -> None:
        ...

    async def release_kv(self, held: Sequence[dict[str, Any]]) -> int:
        """Free the blocks finished prefill requests hold for consumers that will not come, each
        named by the `kv_transfer_params` its answer gave; how many were still held (one pulled
        or expired meanwhile is not). Safe only once no consumer can read them (prefill.claims
        revokes a handoff first)."""
        ...

    async def warm_up(self) -> None:
        """Pay the engine's one-time costs (what its first requests would otherwise wait for)
        before the worker reports ready."""
        ...

    def dead_cause(self) -> str | None:
        ...

    def shutdown(self) -> None:
        ...
