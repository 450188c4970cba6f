"""OpenAI-compatible HTTP frontend: checks the request, sends it to prefill, then its handoff to
decode (or, in the agg graph, the request straight to the one worker), and streams the answer.
It runs no model. With a router, the router picks the prefill replica first
(frontend.placement) and the decode replica for the handoff. The answer's first token is
prefill's, streamed as soon as prefill answers; decode continues after it
(`--first-token-from decode`: the older contract, decode samples it).

Endpoints: POST /v1/chat/completions and /v1/completions (streaming with SSE, or not), GET
/v1/models, /health, /metrics (Prometheus). Every refusal is a 4xx with an OpenAI-style body
`{"error": {"message", "type", "code"}}` (mmhandoff.frontend.request), and nothing is started
for it. When decode fails closed (its KV did not cover the images) or a worker is lost before
decode streamed anything, the request goes through prefill again, at most `retries` times; when
the decode replica streaming an answer is lost, the answer migrates to another one; either way
it continues from the tokens already sent (the request's journey: frontend.journey).
What still fails is a 503 naming the stage, or, once a stream started, an error event and no
`[DONE]` (docs/reliability.md).

A client that goes away mid-answer cancels its handler (aiohttp's handler cancellation); the
open Dynamo streams are closed with it, which stops the worker's handler and aborts the engine
request, freeing its KV. If it goes away while its request is in prefill, or after the first
token but before decode had the handoff, the handoff goes to decode, which is stopped at its
first chunk: that frees prefill's blocks at once instead of at the end of their lease.
Non-streaming answers, and a stream's chunk with the finish reason, carry an extra `mmhandoff`
object with the handoff statistics (OpenAI clients ignore unknown fields). On SIGTERM it stops
taking connections and lets the answers in flight finish (at most DRAIN_S), then exits.
"""

from __future__ import annotations

import asyncio
import logging
import time
from contextlib import aclosing

import msgspec
from aiohttp import web

from mmhandoff import logs
from mmhandoff.frontend import logprobs as oai_logprobs
from mmhandoff.frontend.journey import STALL_S, Journey, Piece, usage
from mmhandoff.frontend.metrics import FrontendMetrics
from mmhandoff.frontend.placement import PrefillPlacement
from mmhandoff.frontend.request import (
    OFF_LOOP_CHARS,
    ApiError,
    FrontendLimits,
    RequestReader,
    StreamOptions,
    choices,
    client_request_id,
    stream_options,
)
from mmhandoff.media.fetch import FetchPolicy
from mmhandoff.wire.messages import Alive, PromptLogprobs, TokenLogprob

log = logging.getLogger(__name__)

__all__ = ["Frontend", "FrontendLimits", "ApiError"]

DRAIN_S = 30.0
# What a connection still open after the drain gets before it is closed. aiohttp waits its
# shutdown timeout for every connection, also for one accepted as the site stopped whose
# request it had not begun to read: with DRAIN_S there, such a request was held 30 s and then
# closed unanswered (reproduced in aiohttp 3.14 alone). The answers in flight have their
# DRAIN_S first (Frontend.stop).
CLOSE_S = 0.5


# Who samples the answer's first token: prefill (streamed as soon as prefill answers; decode
# continues after it) or decode (the older contract: after the handoff, the KV pull and a step).
FIRST_TOKEN_FROM = ("prefill", "decode")


class Frontend:
    def __init__(self, prefill, decode, model: str, *, limits: FrontendLimits = FrontendLimits(),
                 fetch_policy: FetchPolicy = FetchPolicy(), retries: int = 1,
                 migration_limit: int = 3, stall_s: float = STALL_S,
                 first_token_from: str = "prefill", placement: PrefillPlacement | None = None,
                 ignored_fields: frozenset[str] = frozenset()) -> None:
        # Dynamo clients. prefill=None: `decode` takes the request itself (the agg worker).
        self.prefill, self.decode = prefill, decode
        if first_token_from not in FIRST_TOKEN_FROM:
            raise ValueError(f"first_token_from: expected one of {FIRST_TOKEN_FROM}")
        self.first_token_from = first_token_from
        self.model, self.limits = model, limits
        self.reader = RequestReader(model, limits, fetch_policy, ignored_fields)
        self.metrics = FrontendMetrics()
        self.answering = 0  # requests being answered now (as the in-flight gauge)
        self.journey = Journey(prefill, decode, self.metrics, retries=retries,
                               migration_limit=migration_limit, stall_s=stall_s,
                               placement=placement)

    def app(self) -> web.Application:
        app = web.Application(client_max_size=self.limits.max_body_bytes,
                              middlewares=[self._errors])
        app.router.add_get("/health", self._health)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_post("/v1/completions", self._completions)
        return app

    def runner(self) -> web.AppRunner:
        # handler_cancellation: a client that disconnects cancels its handler at once.
        # On SIGTERM `stop` drains the answers in flight first (DRAIN_S; `serve` waits longer).
        return web.AppRunner(self.app(), handler_cancellation=True, shutdown_timeout=CLOSE_S)

    async def stop(self, runner: web.AppRunner, drain_s: float = DRAIN_S) -> None:
        """Stop taking connections, let the answers in flight finish (`drain_s` at most), then
        close what is still open."""
        for site in list(runner.sites):
            await site.stop()
        deadline = asyncio.get_running_loop().time() + drain_s
        while self.answering and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.05)
        await runner.cleanup()

    @web.middleware
    async def _errors(self, request, handler):
        try:
            return await handler(request)
        except web.HTTPRequestEntityTooLarge:
            error = ApiError(413, f"request body is over {self.limits.max_body_bytes} bytes",
                             "body_too_large")
        except ApiError as e:
            error = e
        except (web.HTTPException, asyncio.CancelledError):
            raise
        except Exception as e:  # a bug
            error = _internal(request, e)
        self.metrics.errors.labels(error.code).inc()
        return web.json_response(
            {"error": {"message": str(error), "type": error.kind, "code": error.code}},
            status=error.status)

    async def _health(self, request) -> web.Response:
        """200 while every endpoint it calls has a live instance (Dynamo discovery), else 503."""
        instances = {name: len(c.instance_ids()) for name, c in
                     (("prefill", self.prefill), ("decode", self.decode)) if c is not None}
        ok = all(instances.values())
        return web.json_response({"status": "ok" if ok else "unavailable",
                                  "instances": instances}, status=200 if ok else 503)

    async def _metrics(self, request) -> web.Response:
        return web.Response(body=self.metrics.render(),
                            headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})

    async def _models(self, request) -> web.Response:
        return web.json_response({"object": "list", "data": [
            {"id": self.model, "object": "model", "owned_by": "mmhandoff", "created": 0}]})

    # ---- the two generation APIs --------------------------------------------------------------
    async def _chat(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, "chat", self.reader.chat)

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, "completions", self.reader.completion)

    async def _generate(self, request, api: str, read) -> web.StreamResponse:
        self.metrics.requests.labels(api).inc()
        t0 = time.perf_counter()
        client_id = client_request_id(request.headers.get("X-Request-Id"))
        try:  # msgspec: a 200 KB body with an image parses in a third of json.loads' time
            raw = await request.read()
            # a body with a photo (8 MB: ~3 ms) is parsed off the event loop
            body = (await asyncio.to_thread(msgspec.json.decode, raw) if len(raw) > OFF_LOOP_CHARS
                    else msgspec.json.decode(raw))
        except (msgspec.DecodeError, RecursionError):  # RecursionError: nested too deep
            raise ApiError(400, "request body is not valid JSON", "invalid_json") from None
        options = stream_options(body)  # before read() fetches any image
        n, echo = choices(body, api)
        prefill_request = await read(body)
        if echo and prefill_request.sampling.logprobs is not None:  # the prompt's too, as vLLM
            prefill_request = msgspec.structs.replace(
                prefill_request, prompt_logprobs=prefill_request.sampling.logprobs)
        if client_id is not None:  # the answer's id, and every component's log line, carry it
            prefix = prefill_request.request_id.split("-", 1)[0]
            prefill_request = msgspec.structs.replace(prefill_request,
                                                      request_id=f"{prefix}-{client_id}")
        reply_id = client_id or prefill_request.request_id
        # decode samples the first token too: the older contract (benchmarks compare them), or
        # settings that need one engine to sample the whole answer (penalties, stop strings)
        if (self.first_token_from == "decode"
                or prefill_request.sampling.whole_answer_on_one_engine()):
            prefill_request = msgspec.structs.replace(prefill_request, first_token=False)
        requests = [prefill_request] if n == 1 else [_nth(prefill_request, i) for i in range(n)]
        shown = prefill_request.prompt if echo else ""  # each answer's text starts with it
        self.metrics.in_flight.inc()
        self.answering += 1
        try:
            async with aclosing(self.journey.answers(requests, t0)) as pieces:
                if options.stream:
                    return await self._stream(request, api, prefill_request.request_id, pieces,
                                              options, reply_id, shown)
                texts, lasts = [shown] * n, [Piece("")] * n
                entries: list[list[TokenLogprob]] = [[] for _ in range(n)]
                prompts: list[PromptLogprobs | None] = [None] * n
                async for piece in pieces:
                    texts[piece.index] += piece.text
                    lasts[piece.index] = piece
                    entries[piece.index] += piece.logprobs or []
                    prompts[piece.index] = prompts[piece.index] or piece.prompt_logprobs
                asked = prefill_request.sampling.logprobs is not None
                logprobs = [oai_logprobs.for_api(api, e if asked else None, prompt=p)
                            for e, p in zip(entries, prompts)]
                return web.json_response(
                    _whole(api, prefill_request.request_id, self.model, texts, lasts, logprobs),
                    headers={"X-Request-Id": reply_id})
        except (asyncio.CancelledError, ConnectionResetError):
            self.metrics.disconnects.inc()  # the client left; aclosing aborted the request
            raise
        finally:
            self.metrics.in_flight.dec()
            self.answering -= 1

    async def _stream(self, request, api, request_id, pieces, options: StreamOptions,
                      reply_id: str, shown: str) -> web.StreamResponse:
        """`shown`: text each answer starts with (completions' echo of the prompt)."""
        first = await anext(pieces)  # errors before the first token still get a 4xx/5xx
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                               "Cache-Control": "no-cache",
                                               "X-Request-Id": reply_id})
        await response.prepare(request)
        created = int(time.time())

        async def send(event: dict) -> None:
            await response.write(b"data: " + msgspec.json.encode(event) + b"\n\n")

        offsets: dict[int, int] = {}  # per answer: its text so far
        usage: dict[int, dict | None] = {}  # per answer: its usage so far

        async def send_piece(piece: Piece) -> None:
            if piece.index not in offsets:  # an answer's first piece
                piece.text = shown + piece.text
                offsets[piece.index] = 0
            usage[piece.index] = piece.usage
            await send(_chunk(api, request_id, self.model, created, piece, options,
                              offsets[piece.index]))
            offsets[piece.index] += len(piece.text)
            if piece.prompt_logprobs is not None:  # the prompt's tokens were counted instead
                offsets[piece.index] = oai_logprobs.text_length(piece.prompt_logprobs,
                                                                piece.logprobs)

        try:
            last = first
            await send_piece(first)
            async for last in pieces:
                await send_piece(last)
            if options.include_usage:  # OpenAI's last chunk: no choice, the whole usage
                final = _chunk(api, request_id, self.model, created, last, options)
                final.pop("mmhandoff", None)  # sent with the finish reason
                await send({**final, "choices": [], "usage": _total(list(usage.values()))})
        except (asyncio.CancelledError, ConnectionResetError):
            raise
        except Exception as e:  # the status is sent: the stream says it failed, and no [DONE]
            error = e if isinstance(e, ApiError) else _internal(request, e)
            self.metrics.errors.labels(error.code).inc()
            await send({"error": {"message": str(error), "type": error.kind, "code": error.code}})
        else:
            await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response



def _internal(request, e: Exception) -> ApiError:
    """A bug of ours: logged with its cause; the client gets a 500 (or an error event)."""
    log.warning(f"[frontend] {request.method} {request.path} failed: {e!r}")
    return ApiError(500, f"internal error: {type(e).__name__}", "internal", "server_error")


# ---- OpenAI response shapes ------------------------------------------------------------------
def _nth(request, i: int):
    """The i-th of `n` answers to one prompt, as vLLM's parallel sampling makes it: its own
    request, seeded with seed + i."""
    s = request.sampling
    return msgspec.structs.replace(request, request_id=f"{request.request_id}-{i}",
                                   sampling=msgspec.structs.replace(
                                       s, seed=None if s.seed is None else s.seed + i))


def _total(usages: list[dict | None]) -> dict | None:
    """The usage of `n` answers to one prompt: the prompt once, every answer's tokens."""
    if not usages or any(u is None for u in usages):
        return None
    return usage(usages[0]["prompt_tokens"], sum(u["completion_tokens"] for u in usages))


def _whole(api: str, request_id: str, model: str, texts: list[str], lasts: list[Piece],
           logprobs: list[dict | None]) -> dict:
    """The whole answer: one choice per answer (`n`); `mmhandoff` is the answer's statistics,
    or (`n` > 1) a list of them, one per choice."""
    choices = [({"index": i, "finish_reason": last.finish, "logprobs": lp,
                 "message": {"role": "assistant", "content": text}} if api == "chat" else
                {"index": i, "finish_reason": last.finish, "text": text, "logprobs": lp})
               for i, (text, last, lp) in enumerate(zip(texts, lasts, logprobs))]
    stats = [msgspec.to_builtins(last.stats) if last.stats is not None else None
             for last in lasts]
    return {"id": request_id, "object": "chat.completion" if api == "chat" else "text_completion",
            "created": int(time.time()), "model": model, "choices": choices,
            "usage": _total([last.usage for last in lasts]),
            "mmhandoff": stats[0] if len(stats) == 1 else stats}


def _chunk(api: str, request_id: str, model: str, created: int, piece: Piece,
           options: StreamOptions, offset: int = 0) -> dict:
    """`offset`: where the piece's text starts in the answer (completions' logprobs)."""
    logprobs = oai_logprobs.for_api(api, piece.logprobs, offset, prompt=piece.prompt_logprobs)
    if api == "chat":
        choice = {"index": piece.index,
                  "delta": {"content": piece.text} if piece.text else {},
                  "logprobs": logprobs, "finish_reason": piece.finish}
    else:
        choice = {"index": piece.index, "text": piece.text, "finish_reason": piece.finish,
                  "logprobs": logprobs}
    chunk = {"id": request_id, "object": "chat.completion.chunk" if api == "chat" else
             "text_completion", "created": created, "model": model, "choices": [choice]}
    if options.include_usage:
        chunk["usage"] = piece.usage if options.continuous_usage_stats else None
    if piece.stats is not None:
        chunk["mmhandoff"] = msgspec.to_builtins(piece.stats)
    return chunk


async def _alive(request):
    """The frontend's own discovery entry (plane.registration watches it): its answer says only
    that this process serves."""
    yield msgspec.to_builtins(Alive())


def parser():
    """The frontend's command line (the deploy manifests' args are checked against it)."""
    import argparse

    p = argparse.ArgumentParser(prog="python -m mmhandoff.frontend")
    p.add_argument("--namespace", default="mmhandoff")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--model-name", default="tiny-llava", help="the model id clients ask for")
    p.add_argument("--prefill", default="prefill.generate",
                   help='prefill endpoint, or "none" when the decode endpoint takes the request '
                        "itself (agg graph)")
    p.add_argument("--decode", default="decode.generate",
                   help="the endpoint that streams the answer: decode.generate, "
                        "router.generate (disagg_router) or agg.generate (agg)")
    p.add_argument("--allow-image-networks", default="",
                   help="comma-separated CIDRs that image URLs may reach although not public, "
                        'e.g. "127.0.0.0/8" (default: none)')
    p.add_argument("--image-fetch-timeout-s", type=float, default=10.0)
    p.add_argument("--router", default="none",
                   help='the KV router\'s endpoint (e.g. router.generate), which places each '
                        'request on a prefill replica; "none" (default): prefill round robin')
    p.add_argument("--retries", type=int, default=1,
                   help="retries through prefill when decode fails closed or a worker is lost "
                        "before decode streamed anything")
    p.add_argument("--migration-limit", type=int, default=3,
                   help="how many times an answer may continue on another decode replica after "
                        "the one streaming it was lost")
    p.add_argument("--first-token-from", choices=FIRST_TOKEN_FROM, default="prefill",
                   help="prefill: the client gets prefill's sampled token at once and decode "
                        "continues after it (default); decode: decode samples it (the older "
                        "contract, for comparison)")
    p.add_argument("--stall-timeout-s", type=float, default=STALL_S,
                   help="a worker silent this long (no answer, no next token) counts as lost")
    p.add_argument("--ignore-fields", default="",
                   help="comma-separated request fields to ignore that are neither OpenAI's nor "
                        "vLLM's (some clients send their own); any other unknown field is a 400 "
                        "unknown_parameter (docs/api.md)")
    p.add_argument("--wait-s", type=float, default=600, help="how long to wait for the workers")
    return p


def main(argv: list[str] | None = None) -> int:
    """`python -m mmhandoff.frontend`: serve HTTP once the workers are discoverable."""
    from mmhandoff.plane.runtime import client, run, runtime
    from mmhandoff.plane.runtime import serve as serve_endpoint
    from mmhandoff.process.lifecycle import until_stopped

    p = parser()
    args = p.parse_args(argv)
    logs.setup()
    try:
        policy = FetchPolicy(allow_networks=FetchPolicy.networks(args.allow_image_networks),
                             timeout_s=args.image_fetch_timeout_s)
    except ValueError as e:
        p.error(f"--allow-image-networks: {e}")

    async def serve() -> int:
        rt = runtime(asyncio.get_running_loop())
        names = [n for n in (args.prefill, args.decode) if n != "none"]
        log.info(f"[frontend] waiting for {', '.join(names)} in {args.namespace}")
        prefill = None if args.prefill == "none" else await client(
            rt, f"{args.namespace}.{args.prefill}", args.wait_s)
        decode = await client(rt, f"{args.namespace}.{args.decode}", args.wait_s)
        placement = None
        if args.router != "none" and prefill is not None:
            from mmhandoff.plane.endpoints import PLACE, beside

            placement = PrefillPlacement(await client(
                rt, f"{args.namespace}.{beside(args.router, PLACE)}", args.wait_s), prefill)
        ignored = frozenset(f.strip() for f in args.ignore_fields.split(",") if f.strip())
        frontend = Frontend(prefill, decode, args.model_name, fetch_policy=policy,
                            retries=args.retries, migration_limit=args.migration_limit,
                            stall_s=args.stall_timeout_s, first_token_from=args.first_token_from,
                            placement=placement, ignored_fields=ignored)
        runner = frontend.runner()
        await runner.setup()
        await web.TCPSite(runner, args.host, args.port).start()
        log.info(f"[frontend] ready on http://{args.host}:{args.port}/v1")
        # The frontend's own instance in discovery, watched like a worker's: a runtime that lost
        # its etcd lease sees no worker again (every answer a 503) though the process runs.
        alive = f"{args.namespace}.frontend.alive"
        alive_endpoint = rt.endpoint(alive)  # taken before serving it (plane/registration)
        serving_alive = serve_endpoint(rt, alive, _alive, (), endpoint=alive_endpoint)
        code = await until_stopped("frontend", alive_endpoint)
        serving_alive.cancel()
        await frontend.stop(runner)  # in-flight answers finish (DRAIN_S at most)
        rt.shutdown()
        return code

    return run(serve())


if __name__ == "__main__":
    raise SystemExit(main())
