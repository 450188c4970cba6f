"""A request's journey through the graph, apart from HTTP and OpenAI's shapes (frontend.app):

    answer(request):                                  # each piece as it comes
        while True:
            request, instance = placed(request)       # the router's prefill replica, if any
            answer = prefill(request, instance)       # the first token and the handoff
            yield answer.first
            for chunk in decode(answer.handoff):      # the router's decode replica, if any
                yield chunk
            return
          on a worker lost or decode failed closed:
            nothing streamed yet: retry (`retries`); else migrate (`migration_limit`): the
            request again, continuing from the tokens already sent; past both, the error

`answers` runs a request's `n` answers side by side. In the agg graph there is no prefill: the
request goes to the one worker, which streams the whole answer.
"""

from __future__ import annotations

import asyncio
import logging
import time
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import AsyncIterator

import msgspec

from mmhandoff.frontend.metrics import FrontendMetrics
from mmhandoff.frontend.placement import PrefillPlacement, image_keys
from mmhandoff.frontend.request import ApiError
from mmhandoff.plane.runtime import RemoteError, background, call, call_one
from mmhandoff.wire.messages import (
    AnswerStats,
    DecodeChunk,
    DecodeStats,
    PrefillAnswer,
    PrefillRequest,
    PrefillStats,
    PromptLogprobs,
    TokenLogprob,
)

log = logging.getLogger(__name__)

# Failures of ours that a client may retry later (503); any other fault of ours is a 500.
# "expired": the handoff reached decode after prefill's lease could have freed its blocks;
# "claim_failed": decode could not claim the KV at the prefill holding it (stopped, restarted).
UNAVAILABLE = frozenset({"kv_coverage", "prefill_failed", "decode_failed", "expired",
                         "claim_failed"})
# The same failures are retried through prefill (nothing sent yet) or migrated (tokens sent):
# decode failed closed, or a worker was lost (died, or silent for `stall_s`).
RETRIED = UNAVAILABLE
STALL_S = 120.0  # the longest a worker may stay silent before its request counts as lost
@dataclass
class Piece:
    """One streamed piece of an answer: its usage so far (where prefill said the prompt's
    length); the last one has `finish`, the final `usage` and `stats`."""

    text: str
    finish: str | None = None
    usage: dict | None = None
    stats: AnswerStats | None = None
    logprobs: list[TokenLogprob] | None = None  # one per token, when the request asked
    index: int = 0  # which of the request's `n` answers
    prompt_logprobs: PromptLogprobs | None = None  # an answer's first piece (echo + logprobs)


def api_error(e: RemoteError) -> ApiError:
    """A component's typed error as the client sees it: its fault decides 4xx or 5xx."""
    if e.fault == "client":
        return ApiError(413 if e.code == "request_too_large" else 400, e.message, e.code)
    return ApiError(503 if e.code in UNAVAILABLE else 500, e.message, e.code, "server_error")


@dataclass
class _Sent:
    """An answer's state across its attempts: the client's request, the one going through the
    graph now, what the client has been sent, and how often it went round again."""

    original: PrefillRequest
    request: PrefillRequest
    generated: list[int] = field(default_factory=list)  # token ids sent
    retries: int = 0
    migrations: int = 0
    decoded: bool = False  # this attempt's decode streamed a chunk
    first_token_at: float = 0.0  # unix time the caller delivered the first token
    last_t: float | None = None  # when the last piece came (perf_counter)


class Journey:
    def __init__(self, prefill, decode, metrics: FrontendMetrics, *, retries: int = 1,
                 migration_limit: int = 3, stall_s: float = STALL_S,
                 placement: PrefillPlacement | None = None) -> None:
        # Dynamo clients. prefill=None: `decode` takes the request itself (the agg worker).
        self.prefill, self.decode = prefill, decode
        # a graph with a router: it picks the prefill replica, and `decode` is the router
        self.placement = placement
        self.metrics = metrics
        self.retries, self.migration_limit, self.stall_s = retries, migration_limit, stall_s

    async def answers(self, requests: list, t0: float) -> AsyncIterator[Piece]:
        """The pieces of the request's answers (`n` > 1: one request each, answered side by
        side, each piece tagged with its answer's index), as they come. One that fails ends
        them all with its error."""
        if len(requests) == 1:
            async with aclosing(self.answer(requests[0], t0)) as pieces:
                async for piece in pieces:
                    yield piece
            return
        queue: asyncio.Queue = asyncio.Queue()

        async def answer(i: int, one) -> None:
            try:
                async with aclosing(self.answer(one, t0)) as pieces:
                    async for piece in pieces:
                        piece.index = i
                        await queue.put(piece)
                await queue.put(i)  # this answer is whole
            except Exception as e:
                await queue.put(e)

        tasks = [asyncio.ensure_future(answer(i, one)) for i, one in enumerate(requests)]
        try:
            whole = 0
            while whole < len(tasks):
                item = await queue.get()
                if isinstance(item, Exception):
                    raise item
                if isinstance(item, int):
                    whole += 1
                else:
                    yield item
        finally:  # an error, or the client gone: the other answers stop (their requests abort)
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def answer(self, prefill_request, t0: float) -> AsyncIterator[Piece]:
        """The answer's pieces: prefill's first token as soon as prefill answers, then decode's.
        When a worker fails (RETRIED: decode failed closed, a worker was lost), the request goes
        through prefill again, continuing from the tokens already sent (`continuation`: the
        client never gets a token twice or a different one): a retry (`retries` times at most)
        when the failed attempt's decode had streamed nothing, a migration (`migration_limit`
        times at most) when a decode replica was lost mid-answer. Past those bounds the answer
        ends with the error, never as a silent, short answer."""
        sent = _Sent(prefill_request, prefill_request)
        while True:
            sent.decoded = False
            try:
                async with aclosing(self.attempt(sent.request)) as chunks:
                    async for chunk, prefill_stats, from_decode in chunks:
                        yield self._piece(sent, chunk, prefill_stats, from_decode, t0)
                        # the caller has delivered the first token
                        sent.first_token_at = sent.first_token_at or time.time()
                return
            except RemoteError as e:
                sent.request = self._again(sent, e)  # or the client's error, past the bounds

    def _piece(self, sent: _Sent, chunk: DecodeChunk, prefill_stats: PrefillStats | None,
               from_decode: bool, t0: float) -> Piece:
        """A chunk as the client's next piece, with the usage so far; the last one with the
        answer's statistics. Counts it in `sent` and the metrics."""
        sent.decoded = sent.decoded or from_decode
        now = time.perf_counter()
        if sent.last_t is None:
            self.metrics.ttft.observe(now - t0)
        else:
            self.metrics.itl.observe(now - sent.last_t)
        sent.last_t = now
        # the prompt's logprobs go with the answer's first piece only
        piece = Piece(chunk.text, chunk.finish_reason, logprobs=chunk.logprobs,
                      prompt_logprobs=None if sent.generated else chunk.prompt_logprobs)
        sent.generated += chunk.token_ids
        # the client's prompt: prefill's, less a migration's tokens
        prompt = (prefill_stats.prompt_tokens if prefill_stats is not None
                  else chunk.stats.prompt_tokens if chunk.stats is not None else None)
        if prompt is not None:  # the usage so far (continuous_usage_stats)
            piece.usage = usage(prompt - len(sent.request.continuation), len(sent.generated))
        if piece.finish:
            stats = chunk.stats or DecodeStats(request_bytes=-1, prepare_ms=-1)
            self.metrics.record_decode(stats)
            if piece.usage is not None:
                self.metrics.prompt_tokens.inc(piece.usage["prompt_tokens"])
            self.metrics.completion_tokens.inc(len(sent.generated))
            piece.stats = AnswerStats(
                **msgspec.structs.asdict(stats), prefill=prefill_stats, retries=sent.retries,
                migrations=sent.migrations, first_token_at=sent.first_token_at)
        return piece

    def _again(self, sent: _Sent, e: RemoteError) -> PrefillRequest:
        """The request that goes on after the failure `e` (a retry or a migration, continuing
        from what was sent), or the client's error (raised) when it may not."""
        original = sent.original
        left = original.sampling.max_tokens - len(sent.generated)
        if e.code not in RETRIED or left <= 0:
            raise api_error(e) from None
        if not sent.decoded and sent.retries < self.retries:
            sent.retries += 1
            self.metrics.retries.inc()
        elif sent.decoded and original.sampling.structured is not None:
            raise api_error(e) from None  # its grammar cannot go on from sent tokens
        elif sent.decoded and sent.migrations < self.migration_limit:
            sent.migrations += 1
            self.metrics.migrations.inc()
        else:
            raise api_error(e) from None
        # a bypassed handoff whose blocks were evicted fails closed: prefill this time
        if not sent.generated:
            return msgspec.structs.replace(sent.request, allow_bypass=False)
        sampling = original.sampling
        return msgspec.structs.replace(
            original, continuation=list(sent.generated), allow_bypass=False,
            sampling=msgspec.structs.replace(
                sampling, max_tokens=left,
                min_tokens=max(sampling.min_tokens - len(sent.generated), 0)))

    async def attempt(self, prefill_request
                      ) -> AsyncIterator[tuple[DecodeChunk, PrefillStats | None, bool]]:
        """The answer's chunks, decoded strictly, each with prefill's statistics (None in the agg
        graph, where the one worker takes the request itself) and whether decode streamed it
        (False: prefill's first token)."""
        prefill_request, instance = await self.placed(prefill_request)
        request, prefill_stats, answer = msgspec.to_builtins(prefill_request), None, None
        if self.prefill is not None:
            prefilled = asyncio.ensure_future(call_one(
                self.prefill, request, instance, lost="prefill_failed", stall_s=self.stall_s))
            try:
                raw = await asyncio.shield(prefilled)
            except asyncio.CancelledError:  # the client left while prefill ran
                background(self._release(prefilled))
                raise
            answer = _prefill_answer(raw)
            prefill_stats = answer.stats
        handed = False  # the handoff reached decode, which frees prefill's blocks in any case
        first_chunk = True
        try:
            if answer is not None:
                first = answer.first
                if first is not None:
                    yield (DecodeChunk(request_id=prefill_request.request_id,
                                       token_ids=[first.token_id], text=first.text,
                                       finish_reason=first.finish_reason,
                                       logprobs=None if first.logprob is None
                                       else [first.logprob],
                                       prompt_logprobs=answer.prompt_logprobs),
                           prefill_stats, False)
                    if first.finish_reason is not None:  # the answer ended at prefill
                        return
                request = answer.for_decode()
            finished = False
            async with aclosing(call(self.decode, request, lost="decode_failed",
                                     stall_s=self.stall_s)) as chunks:
                handed = True  # from here decode has it, or the call failed (handed over below)
                async for raw_chunk in chunks:
                    chunk = _decode_chunk(raw_chunk)
                    if first_chunk and answer is not None and answer.first is None:
                        # decode sampled the first token: the prompt's logprobs are prefill's
                        chunk.prompt_logprobs = answer.prompt_logprobs
                    first_chunk = False
                    finished = chunk.finish_reason is not None
                    yield chunk, prefill_stats, True
            if not finished:  # the stream closed cleanly but the answer did not end: lost
                raise RemoteError("decode_failed", "decode's stream ended before the answer did")
        except RemoteError as e:
            if e.code == "decode_failed" and first_chunk and answer is not None \
                    and answer.needs_decode():
                # lost on the way (a router or decode replica gone) before any chunk came back:
                # a decode may have the handoff or not. Another replica settles it: its claim is
                # refused if one did (whose pull frees the blocks), else it claims and pulls,
                # which frees them now instead of at the lease's end (docs/routing.md)
                background(self._hand_over(answer))
            raise
        finally:
            if not handed and answer is not None and answer.needs_decode():
                # the client left after the first token, before decode had the handoff
                background(self._hand_over(answer))

    async def placed(self, prefill_request) -> tuple[PrefillRequest, int | None]:
        """In a graph with a router: the request with its image keys, and the prefill instance
        the router chose for it (None: round robin). A retry or a migration (no bypass) goes
        round robin: the placed replica may be the one that failed."""
        if self.placement is None:
            return prefill_request, None
        keys = image_keys(prefill_request)
        prefill_request = msgspec.structs.replace(prefill_request, image_keys=keys)
        if not prefill_request.allow_bypass or not self.placement.asks(keys):
            return prefill_request, None
        t0 = time.perf_counter()
        instance = await self.placement.instance(prefill_request, keys)
        self.metrics.placement.observe(time.perf_counter() - t0)
        return prefill_request, instance

    async def _release(self, prefilled: asyncio.Future) -> None:
        """Prefill, once done, holds the blocks for decode until they are pulled or its lease
        ends. For a request whose client is gone, hand them to decode and stop after the first
        chunk: the pull (or, if decode aborts first, vLLM's notice to the producer) frees them
        now instead of at the end of the lease."""
        try:
            answer = _prefill_answer(await prefilled)
        except Exception as e:  # nothing to answer to: the lease frees the blocks in the end
            log.warning(f"[frontend] releasing an abandoned handoff failed: {e!r}")
            return
        if answer.needs_decode():
            await self._hand_over(answer)

    async def _hand_over(self, answer: PrefillAnswer, tries: int = 3) -> None:
        """An abandoned answer's handoff to decode, which stops after its first chunk; a call
        lost on the way (a replica gone, not yet out of discovery) is made again."""
        for left in reversed(range(tries)):
            try:
                async with aclosing(call(self.decode, answer.for_decode(), lost="decode_failed",
                                         stall_s=self.stall_s)) as chunks:
                    async for _ in chunks:
                        break
                return
            except Exception as e:
                code = e.code if isinstance(e, RemoteError) else None
                if code in ("replayed", "expired"):
                    # a decode claimed it first (its pull frees the blocks), or prefill revoked
                    # it unclaimed and freed them itself (prefill.claims), or its lease ended
                    return
                if code != "decode_failed" or not left:
                    # nothing to answer to: the lease frees the blocks in the end
                    log.warning(f"[frontend] releasing an abandoned handoff failed: {e!r}")
                    return


def _from_peer(raw, kind: type, what: str):
    """A message from another of our components, decoded strictly: malformed is our fault."""
    try:
        return msgspec.convert(raw, kind)
    except msgspec.ValidationError as e:
        raise RemoteError("internal", f"{what} malformed: {e}") from None


def _prefill_answer(raw) -> PrefillAnswer:
    return _from_peer(raw, PrefillAnswer, "prefill answered a message")


def _decode_chunk(raw) -> DecodeChunk:
    return _from_peer(raw, DecodeChunk, "decode streamed a chunk")


def usage(prompt: int, completion: int) -> dict:
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion}
