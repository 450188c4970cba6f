"""FakeEngine: a deterministic mmhandoff.engine.Engine without a model, for fast tests of the
logic around engines (workers, frontend, retries, refusals). Never the only test of a path: the
engine tier runs the same paths on vLLM.

- Tokens: one per whitespace-separated word (a stable hash), and IMAGE_TOKENS placeholder
  tokens per "<image>" in the prompt, one image each, identified by its content hash.
- Answers: each token is a hash of (the prompt's token ids followed by the answer's tokens so
  far, image hashes), autoregressive like a model. An agg request and a handoff of the same
  prompt and images therefore give the same answer, different images give different answers,
  and a prompt extended by an answer's first k tokens (a migrated request) goes on with token
  k + 1. Sampling settings other than max_tokens and stop_token_ids are not modelled.
- KV: engines built on one FakeKV share it, like engines that reach each other through NIXL. A
  prefill request (kv_transfer_params `do_remote_decode`) leaves its prompt's KV there under a
  fresh key; a request that names such a key takes it (once). A request whose key is not there,
  or a KV-only request with images and no key, ends as vLLM's fail-closed scheduler ends it:
  finish reason "error" and a kv_failure. A prefill request that stops (a stop token) with
  RELEASE_ON_STOP_KEY leaves nothing there, as the adapter's connector frees it.
- Roles as in EngineSpec: a "decode" engine has no vision tower and refuses images.
"""

from __future__ import annotations

import asyncio
import hashlib
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Sequence

from mmhandoff.engine import (
    RELEASE_ON_STOP_KEY,
    Capabilities,
    EngineInputError,
    PixelsNeeded,
    Rendered,
    Step,
)
from mmhandoff.media.images import LoadedImage
from mmhandoff.wire.handoff import Features, Handoff, Sampling, Span
from mmhandoff.wire.messages import PromptLogprobs, TokenLogprob

IMAGE = "<image>"
IMAGE_TOKENS = 4
IMAGE_TOKEN_ID = 3
BLOCK_SIZE = 4  # tokens per (pretend) KV block
VOCAB = 1000


def _h(*parts: object) -> int:
    return int.from_bytes(hashlib.sha256(repr(parts).encode()).digest()[:8], "big")


def _prompt_logprobs(token_ids: list[int]) -> PromptLogprobs:
    """A made-up but deterministic log probability per prompt token after the first."""
    return PromptLogprobs(first_token_id=token_ids[0], first_token=f" w{token_ids[0]}", rest=[
        TokenLogprob(token_id=t, token=f" w{t}", logprob=-1.0 - t % 5) for t in token_ids[1:]])


def _word(word: str) -> int:
    return 10 + _h("word", word) % (VOCAB - 10)


@dataclass
class FakeKV:
    """KV blocks left by prefill requests, by key: what decode pulls."""

    blocks: dict[str, tuple[list[int], list[str]]] = field(default_factory=dict)


@dataclass
class FakeRequest:
    token_ids: list[int]
    image_hashes: list[str]
    max_tokens: int
    kv_transfer_params: dict[str, Any] | None
    kv_only: bool = False
    stop_token_ids: list[int] = field(default_factory=list)
    sent_in_prompt: int = 0  # prefill's first token at the prompt's end: not pulled
    prompt_logprobs: int | None = None


class FakeEngine:
    def __init__(self, *, role: str = "agg", kv: FakeKV | None = None, model: str = "fake",
                 max_model_len: int = 2048, step_s: float = 0.0, pull_s: float = 0.0,
                 mrope: bool = False) -> None:
        """`step_s`: time per generated token; `pull_s`: time to pull KV before the first one."""
        self.role = role
        self.kv = kv if kv is not None else FakeKV()
        self.max_model_len = max_model_len
        self.step_s, self.pull_s = step_s, pull_s
        self.fingerprint = hashlib.sha256(f"fake:{model}".encode()).hexdigest()
        self.capabilities = Capabilities(mrope=mrope, vision=role != "decode")
        self.running: set[str] = set()  # unfinished request ids: a test checks nothing leaks
        self.aborted: list[str] = []  # every abort asked for
        self.discarded: list[Rendered] = []  # renders never submitted (discard)
        self.processed: set[str] = set()  # images rendered with pixels (vLLM's processor cache)
        self.block_size = BLOCK_SIZE
        self._dead: str | None = None

    # ---- Engine ---------------------------------------------------------------------------
    def chat_prompt(self, conversation: list[dict[str, Any]]) -> str:
        out = []
        for m in conversation:
            content = m["content"]
            if not isinstance(content, str):
                content = " ".join(IMAGE if p["type"] == "image" else p.get("text", "")
                                   for p in content)
            out.append(f"<|{m['role']}|> {content}")
        return " ".join(out) + " <|assistant|>"

    def presizer(self):  # it processes no pixels
        return None

    def load_video(self, data_uri: str):
        raise EngineInputError("the fake engine takes no video")

    async def render(self, prompt: str, images: Sequence[LoadedImage]) -> Rendered:
        if any(i.modality != "image" for i in images):
            raise EngineInputError("the fake engine takes no video")
        pieces = prompt.split(IMAGE)
        if len(pieces) - 1 != len(images):
            raise EngineInputError(f"{len(pieces) - 1} image placeholders, {len(images)} images")
        if images and not self.capabilities.vision:
            raise EngineInputError("this engine has no vision tower")
        if any(i.image is None and i.content_hash not in self.processed for i in images):
            raise PixelsNeeded("an image without pixels that was never processed")
        self.processed.update(i.content_hash for i in images)
        ids: list[int] = []
        spans = []
        for n, piece in enumerate(pieces):
            ids += [_word(w) for w in piece.split()]
            if n < len(images):
                spans.append(Span(offset=len(ids), length=IMAGE_TOKENS))
                ids += [IMAGE_TOKEN_ID] * IMAGE_TOKENS
        self._check_length(ids)
        hashes = [i.content_hash for i in images]
        features = Features(mm_hashes={"image": hashes} if images else {},
                            mm_placeholders={"image": spans} if images else {})
        return Rendered(ids, features, hashes)

    def request(self, rendered: Rendered, sampling: Sampling, *, max_tokens: int | None = None,
                kv_transfer_params: dict[str, Any] | None = None,
                cache_salt: str | None = None, continued: int = 0,
                prompt_logprobs: int | None = None) -> FakeRequest:
        return FakeRequest(list(rendered.token_ids), list(rendered.engine_input),
                           sampling.max_tokens if max_tokens is None else max_tokens,
                           kv_transfer_params, stop_token_ids=list(sampling.stop_token_ids),
                           prompt_logprobs=prompt_logprobs)

    def block_hashes(self, rendered: Rendered, cache_salt: str | None, upto: int) -> list:
        ids, images = rendered.token_ids, list(rendered.engine_input)
        return [_h("block", cache_salt, tuple(ids[:end]), tuple(images))
                for end in range(BLOCK_SIZE, min(upto, len(ids)) + 1, BLOCK_SIZE)]

    def discard(self, rendered: Rendered) -> None:
        self.discarded.append(rendered)

    def extend(self, rendered: Rendered, token_ids: list[int]) -> Rendered:
        ids = [*rendered.token_ids, *token_ids]
        self._check_length(ids)
        return Rendered(ids, rendered.features, rendered.engine_input, rendered.first_sent)

    async def kv_only(self, handoff: Handoff, request_id: str) -> FakeRequest:
        ids, max_tokens = list(handoff.token_ids), handoff.sampling.max_tokens
        if handoff.first_token is not None:  # the answer goes on after prefill's token
            ids, max_tokens = ids + [handoff.first_token], max_tokens - 1
        self._check_length(ids)
        return FakeRequest(ids, list(handoff.features.mm_hashes.get("image", [])), max_tokens,
                           dict(handoff.kv_transfer_params), kv_only=True,
                           stop_token_ids=list(handoff.sampling.stop_token_ids),
                           sent_in_prompt=len(ids) - len(handoff.token_ids))

    async def generate(self, request: FakeRequest, request_id: str) -> AsyncIterator[Step]:
        if self._dead:
            raise RuntimeError(f"engine is dead: {self._dead}")
        self.running.add(request_id)
        try:
            params = request.kv_transfer_params or {}
            key = params.get("fake_kv")
            failure = None
            if key is not None:  # a pull from another engine; a failed load fails the request
                await asyncio.sleep(self.pull_s)
                if self.kv.blocks.pop(key, None) is None:
                    failure = "kv_load_failed: the blocks are not there"
            elif request.kv_only and request.image_hashes:
                failure = "kv_coverage: image positions would be computed, and there is no KV"
            if failure is not None:
                yield Step([], "", finish_reason="error", prompt_tokens=len(request.token_ids),
                           kv_failure=failure)
                return
            context = list(request.token_ids)
            for k in range(request.max_tokens):
                await asyncio.sleep(self.step_s)
                if request_id in self.aborted:
                    return
                token = 10 + _h(context, request.image_hashes) % (VOCAB - 10)
                context.append(token)
                stopped = token in request.stop_token_ids
                step = Step([token], "" if stopped else f" w{token}",
                            prompt_tokens=len(request.token_ids))
                if k == 0 and request.prompt_logprobs is not None:
                    step.prompt_logprobs = _prompt_logprobs(request.token_ids)
                if stopped or k == request.max_tokens - 1:
                    step.finish_reason = "stop" if stopped else "length"
                    pulled = (len(request.token_ids) - request.sent_in_prompt
                              if key is not None else 0)
                    step.kv_stats = {"local": len(request.token_ids) - pulled,
                                     "external": pulled, "covered": len(request.token_ids)}
                    released = stopped and params.get(RELEASE_ON_STOP_KEY)
                    if params.get("do_remote_decode") and not released:
                        new_key = uuid.uuid4().hex
                        self.kv.blocks[new_key] = (request.token_ids, request.image_hashes)
                        step.kv_transfer_params = {"fake_kv": new_key}
                yield step
                if step.finished:
                    return
        finally:
            self.running.discard(request_id)

    async def warm_up(self) -> None:  # nothing to pay
        return None

    async def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)  # every call, as asked: a finished one is a no-op

    async def release_kv(self, held: Sequence[dict[str, Any]]) -> int:
        return sum(self.kv.blocks.pop(p.get("fake_kv"), None) is not None for p in held)

    def dead_cause(self) -> str | None:
        return self._dead

    def shutdown(self) -> None:
        self._dead = self._dead or "shut down"

    # ---- for tests ----------------------------------------------------------------------------
    def kill(self, cause: str = "engine core process is gone") -> None:
        self._dead = cause

    def _check_length(self, ids: list[int]) -> None:
        if len(ids) >= self.max_model_len:
            raise EngineInputError(f"the prompt ({len(ids)} tokens) is longer than the model's "
                                   f"maximum context ({self.max_model_len} tokens)")
