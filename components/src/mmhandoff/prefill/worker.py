"""Encode/prefill worker: the whole VLM; turns a chat request with images into the answer's first
token and a Handoff.

It renders the messages, gives every image its content hash as identifier, runs prefill with
`max_tokens=1` and `do_remote_decode` (the NIXL producer then holds the blocks until decode pulls
them or the lease ends), and answers with the token it sampled (the answer's first: the client
gets it at once) and a Handoff that carries no media, with which decode continues after that
token. When that token ends the answer (a stop token, or the client asked for one token), there
is no handoff and no blocks are held: `max_tokens` 1 runs without `do_remote_decode`, and a stop
frees the blocks at once (RELEASE_ON_STOP_KEY). A request with `first_token` False gets the older
contract: prefill's token is dropped and decode samples the first token. With a router and
`bypass_max_tokens`, a prompt a decode replica already holds is not prefilled at all
(prefill.bypass): the handoff names no KV and decode samples every token.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from contextlib import aclosing
from typing import AsyncIterator, Callable

import msgspec

from mmhandoff.engine import RELEASE_ON_STOP_KEY, Engine, EngineInputError, Rendered, Step
from mmhandoff.engine.prompt import InvalidRequest, PromptBuilder
from mmhandoff.media.images import ImageError, ImageLimits
from mmhandoff.media.pool import MediaPool
from mmhandoff.plane.endpoints import CLAIM, generate
from mmhandoff.prefill.bypass import decode_can_answer
from mmhandoff.prefill.claims import ERRORS as CLAIM_ERRORS, ClaimBook
from mmhandoff.prefill.prefixes import image_ends, prefix_blocks
from mmhandoff.wire.handoff import (
    VERSION,
    BlockHashes,
    Handoff,
    decode_handoff,
    encode_handoff,
    sign,
)
from mmhandoff.wire.messages import (
    FirstToken,
    PrefillAnswer,
    PrefillRequest,
    PrefillStats,
    PromptLogprobs,
)

log = logging.getLogger(__name__)

__all__ = ["InvalidRequest", "PrefillError", "PrefillWorker"]


# How long a signed handoff stays valid: well inside prefill's KV lease. Past the lease prefill
# frees the blocks and may reuse them, and a late pull would read whatever they hold then (a NIXL
# read of registered memory succeeds), answer with it and keep it in decode's prefix cache under
# this prompt's hashes. Decode refuses an expired handoff; the frontend prefills again. The
# margin covers the trip from admission to the engine's first lease heartbeat.
VLLM_KV_LEASE_S = 30  # vLLM's kv_lease_duration when --kv-lease-s is not given
HANDOFF_TTL_S = VLLM_KV_LEASE_S * 2 / 3


# A handoff still unclaimed this long after it was issued is revoked and its blocks freed
# (prefill.claims): decode claims at admission, milliseconds after the frontend delivers it.
RELEASE_UNCLAIMED_S = 5.0


def handoff_ttl(kv_lease_s: int | None) -> float:
    """A handoff's validity for prefill's KV lease: two thirds of it."""
    return (kv_lease_s or VLLM_KV_LEASE_S) * 2 / 3


def carried(hashes: list, block_size: int) -> BlockHashes | None:
    """The handoff's block hashes: None when the engine gives them as bytes (vLLM's
    VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0), which routers then compute themselves."""
    if not all(type(h) is int for h in hashes):
        return None
    return BlockHashes(block_size=block_size, hashes=hashes)


def media_counts(media) -> dict[str, int]:
    """PrefillStats' counts of a request's images and videos, and their bytes as sent."""
    counts = {"images": 0, "image_bytes": 0, "videos": 0, "video_bytes": 0}
    for item in media:
        counts[f"{item.modality}s"] += 1
        counts[f"{item.modality}_bytes"] += item.source_bytes
    return counts


class PrefillError(RuntimeError):
    code = "prefill_failed"
    fault = "server"


class PrefillWorker:
    """A chat request in, the answer's first token and the signed handoff's bytes out (see the
    module's docstring). The benchmark arm in which decode gets the media again subclasses it
    (prefill.full_media)."""

    # prefill's sampled token is the answer's first (unless the request asks for the older
    # contract); False: decode samples it
    first_token_here = True

    def __init__(self, engine: Engine, *, limits: ImageLimits = ImageLimits(),
                 key: bytes | None = None,
                 ttl_s: float = HANDOFF_TTL_S, router=None, bypass_max_tokens: int = 0,
                 publish_prefixes: Callable[[dict[str, list]], None] | None = None,
                 claims: ClaimBook | None = None,
                 release_unclaimed_s: float = RELEASE_UNCLAIMED_S,
                 pool: MediaPool | None = None, image_decode: str = "exact") -> None:
        """`key`: sign every handoff with it, with a nonce and an expiry `ttl_s` from now
        (decode is given the same key). `router` (a RouterLookup) and `bypass_max_tokens` > 0:
        skip the engine for a prompt a decode replica can answer from its own cache (bypass).
        `claims`: with a key, each handoff that names KV names this prefill as where to claim
        it, and the book grants it once (prefill.claims); one unclaimed after
        `release_unclaimed_s` is revoked and its blocks freed (0: left to the lease).
        `pool`: the processes that prepare images (media.pool), ready at warm-up;
        `image_decode`: engine.prompt.IMAGE_DECODES."""
        self.engine = engine
        self.prompts = PromptBuilder(engine, limits, pool=pool, image_decode=image_decode)
        self.key, self.ttl_s = key, ttl_s
        self.router, self.bypass_max_tokens = router, bypass_max_tokens
        # what each image key's prefix is in this engine's blocks, for the router's placement
        # (prefill.prefixes): the process's kv_blocks feed takes them; None: nobody does
        self.publish_prefixes = publish_prefixes
        self.claims = claims if key is not None else None  # a claim is of a signed nonce
        self.release_unclaimed_s = release_unclaimed_s
        self._releasing: asyncio.Task | None = None  # while handoffs wait for their claims

    async def warm_up(self) -> None:
        self.prompts.start()

    def close(self) -> None:
        self.prompts.close()

    def side_handler(self, name: str):
        """The claim endpoint's handler (prefill.claims), the process's one side endpoint; with
        no key, no handoff names it, and a claim finds nothing to grant."""
        assert name == CLAIM, name
        book = self.claims if self.claims is not None else ClaimBook(lambda: None)
        return book.handle, CLAIM_ERRORS

    async def prefill(self, request: PrefillRequest) -> PrefillAnswer:
        """The answer's first token (unless `request.first_token` is False), the handoff for
        decode (none when that token ended the answer) and the statistics."""
        t0 = time.perf_counter()
        media = await self.prompts.media(request)
        media_ms = (time.perf_counter() - t0) * 1e3
        first_token = request.first_token and self.first_token_here
        one_token = first_token and request.sampling.max_tokens == 1
        kv_params = None if one_token else {"do_remote_decode": True,
                                            RELEASE_ON_STOP_KEY: first_token}
        rendered = await self._render(request, media)
        bypass = await self._bypass(request, rendered)
        if bypass is not None:
            self.engine.discard(rendered)  # the engine never gets it
            return PrefillAnswer(handoff=bypass, stats=PrefillStats(
                **media_counts(media), prompt_tokens=len(rendered.token_ids),
                prepare_ms=(time.perf_counter() - t0) * 1e3, media_ms=media_ms, prefill_ms=0.0,
                bypassed=True))
        # the handoff's block hashes, beside the engine's prefill (routers look them up)
        hashing = asyncio.get_running_loop().run_in_executor(None, self._hashes, request,
                                                             rendered)
        for attempt in (1, 2):
            if attempt == 2:
                rendered = await self._render(request, media)
            t1 = time.perf_counter()
            final, token_ids, text, logprobs, prompt_lps = await self._sample(
                request, rendered, kv_params)
            # An error with no token is the engine's retryable answer when its cache of
            # processed images drifted from the renderer's (vLLM: a render never submitted,
            # e.g. a prompt refused as too long, leaves the image marked as sent); rendering
            # again resends the images.
            if attempt == 1 and final is not None and final.finish_reason == "error" \
                    and not token_ids:
                continue
            break
        if final is None or len(token_ids) != 1:
            raise PrefillError(f"prefill of {request.request_id} sampled {len(token_ids)} tokens "
                               f"(finish reason {final and final.finish_reason})")
        hashes = await hashing
        if self.publish_prefixes is not None and request.image_keys:
            # after the answer is on its way
            asyncio.get_running_loop().call_soon(self._publish_prefixes, self.publish_prefixes,
                                                 request, rendered, hashes)
        ended = first_token and (one_token or final.finish_reason == "stop")
        stats = PrefillStats(
            **media_counts(media), prompt_tokens=len(rendered.token_ids),
            prepare_ms=(t1 - t0) * 1e3, media_ms=media_ms,
            prefill_ms=(time.perf_counter() - t1) * 1e3, cached_tokens=final.cached_tokens)
        first = (FirstToken(token_id=token_ids[0], text=text,
                            finish_reason=final.finish_reason if ended else None,
                            logprob=logprobs[0] if logprobs else None)
                 if first_token else None)
        if ended:
            return PrefillAnswer(first=first, stats=stats, prompt_logprobs=prompt_lps)
        if not final.kv_transfer_params:
            raise PrefillError(f"prefill of {request.request_id} returned no KV transfer params")
        return self._for_decode(request, rendered, final, first, stats, prompt_lps, hashes)

    def _for_decode(self, request: PrefillRequest, rendered: Rendered, final: Step,
                    first: FirstToken | None, stats: PrefillStats,
                    prompt_lps: PromptLogprobs | None, hashes: list) -> PrefillAnswer:
        """The answer with decode's message: the handoff, signed and encoded."""
        handoff = Handoff(
            v=VERSION,
            request_id=request.request_id,
            model_fingerprint=self.engine.fingerprint,
            token_ids=rendered.token_ids,
            features=rendered.features,
            requires_kv=True,
            kv_transfer_params=final.kv_transfer_params,
            sampling=request.sampling,
            cache_salt=request.cache_salt,
            continued=len(request.continuation),
            first_token=first.token_id if first is not None else None,
            block_hashes=carried(hashes, self.engine.block_size),
            claim=self.claims.at() if self.claims is not None else None,
        )
        return PrefillAnswer(first=first, handoff=self._sealed(handoff), stats=stats,
                             prompt_logprobs=prompt_lps)

    def _sealed(self, handoff: Handoff) -> bytes:
        """The handoff's bytes, signed: encoded once, here; every hop carries them as they are."""
        if self.key is not None:
            handoff = sign(handoff, self.key, ttl_s=self.ttl_s)
        if handoff.claim is not None:
            self.claims.issue(handoff)
            if self.release_unclaimed_s > 0 and (self._releasing is None
                                                 or self._releasing.done()):
                self._releasing = asyncio.get_running_loop().create_task(
                    self._release_unclaimed())
        return encode_handoff(handoff)

    async def _release_unclaimed(self) -> None:
        """Revoke and free, every fraction of `release_unclaimed_s`, the handoffs nobody
        claimed in time, until every handoff issued is claimed or revoked (the next one issued
        starts it again)."""
        every = min(1.0, self.release_unclaimed_s / 4)
        while self.claims.unsettled():
            await asyncio.sleep(every)
            held = self.claims.revoke_unclaimed(self.release_unclaimed_s)
            if not held:
                continue
            try:
                freed = await self.engine.release_kv(held)
            except Exception:  # the engine stopping or dead: its blocks go with it
                log.exception("freeing %d unclaimed handoffs' KV failed", len(held))
                continue
            log.info("%d handoffs unclaimed after %.0f s revoked; %d still held KV, freed now",
                     len(held), self.release_unclaimed_s, freed)

    async def _bypass(self, request: PrefillRequest, rendered: Rendered) -> bytes | None:
        """The handoff that sends `request` straight to a decode replica holding its KV
        (prefill.bypass), or None: no router, bypass off or not allowed for this request, a
        continued answer, the router away, or no replica holds enough."""
        if (self.router is None or self.bypass_max_tokens <= 0 or not request.allow_bypass
                or request.continuation
                or request.prompt_logprobs is not None):  # only this engine computes those
            return None
        handoff = Handoff(
            v=VERSION, request_id=request.request_id, model_fingerprint=self.engine.fingerprint,
            token_ids=rendered.token_ids, features=rendered.features,
            requires_kv=bool(rendered.features.mm_hashes), kv_transfer_params={},
            sampling=request.sampling, cache_salt=request.cache_salt,
            block_hashes=carried(self._hashes(request, rendered), self.engine.block_size))
        sealed = self._sealed(handoff)  # before the router sees it: it trusts signed hashes only
        try:
            held = await self.router.held(sealed)
        except Exception as e:  # the router is a hint: without it, prefill as usual
            log.warning(f"[prefill] router lookup failed ({e!r}): prefilling")
            return None
        if not decode_can_answer(handoff, held, self.engine.block_size, self.bypass_max_tokens):
            return None
        return sealed

    def _hashes(self, request: PrefillRequest, rendered: Rendered) -> list:
        """The engine's hashes of the prompt's full blocks (what routers look up)."""
        return self.engine.block_hashes(rendered, request.cache_salt, len(rendered.token_ids))

    def _publish_prefixes(self, publish: Callable[[dict[str, list]], None],
                          request: PrefillRequest, rendered: Rendered, hashes: list) -> None:
        """Tell routers which of this engine's blocks (`hashes`: the prompt's) each of the
        request's image keys stands for (its engine now holds them in its prefix cache)."""
        ends = image_ends(rendered.features)
        if not ends or len(ends) != len(request.image_keys):
            return
        prefixes = prefix_blocks(request.image_keys, ends, hashes, self.engine.block_size)
        if prefixes:
            publish(prefixes)

    async def _render(self, request: PrefillRequest, media) -> Rendered:
        rendered = await self.prompts.render(request, media)
        if request.continuation:
            rendered = self.engine.extend(rendered, request.continuation)
        return rendered

    async def _sample(self, request: PrefillRequest, rendered: Rendered, kv_params
                      ) -> tuple[Step | None, list[int], str, list, PromptLogprobs | None]:
        """Prefill and its one sampled token: (last step, token ids, text, their logprobs when
        asked, the prompt's logprobs when asked)."""
        engine_request = self.engine.request(rendered, request.sampling, max_tokens=1,
                                             kv_transfer_params=kv_params,
                                             cache_salt=request.cache_salt,
                                             continued=len(request.continuation),
                                             prompt_logprobs=request.prompt_logprobs)
        final, token_ids, text, logprobs, prompt_lps = None, [], "", [], None
        engine_request_id = f"{request.request_id}:prefill:{uuid.uuid4().hex[:8]}"
        async with aclosing(self.engine.generate(engine_request, engine_request_id)) as steps:
            async for step in steps:
                final = step
                token_ids += step.token_ids
                text += step.text
                logprobs += step.logprobs or []
                prompt_lps = prompt_lps or step.prompt_logprobs
        return final, token_ids, text, logprobs, prompt_lps

    async def handle(self, request: dict) -> AsyncIterator[dict]:
        """Dynamo endpoint handler: a PrefillRequest in its builtin form in, one PrefillAnswer
        out."""
        yield msgspec.to_builtins(await self.prefill(self.prompts.from_wire(request)))

    async def handoff(self, request: PrefillRequest) -> tuple[Handoff, PrefillStats]:
        """The handoff alone (in-process callers and tests): its `first_token` is the answer's
        first; a request whose answer ends at that token has none (PrefillError)."""
        answer = await self.prefill(request)
        if answer.handoff is None:
            raise PrefillError(f"the answer to {request.request_id} ended at its first token")
        return decode_handoff(answer.handoff), answer.stats


ENDPOINT = generate("prefill")
ERRORS = (ImageError, InvalidRequest, EngineInputError, PrefillError)
