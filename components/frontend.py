"""OpenAI-compatible HTTP frontend: checks the request, sends it to prefill, then its handoff to
decode, and streams the answer. It runs no model.

Endpoints: POST /v1/chat/completions (streaming with SSE, or not), GET /v1/models, GET /health.
Every refusal is a 4xx with an OpenAI-style body `{"error": {"message", "type", "code"}}`, and
nothing is started for it. When decode fails closed (its KV did not cover the images), the whole
request is retried through prefill, at most `retries` times; then the client gets a 503 naming
the cause.

Not yet (issue 3): image URLs (http/https behind a fetch guard), /v1/completions, /metrics.
"""

from __future__ import annotations

import io
import json
import time
import uuid
from dataclasses import dataclass
from typing import Any, AsyncIterator

import msgspec
from aiohttp import web
from PIL import Image, UnidentifiedImageError

from components.handoff import Sampling
from components.images import ImageError, ImageLimits, ImageTooLarge, data_uri_bytes
from components.protocol import PrefillRequest
from components.runtime import RemoteError, call


@dataclass(frozen=True)
class FrontendLimits:
    max_body_bytes: int = 48 * 1024 * 1024
    max_image_bytes: int = 32 * 1024 * 1024
    max_image_pixels: int = 50_000_000
    max_images: int = 8
    max_tokens: int = 4096


class ApiError(Exception):
    def __init__(self, status: int, message: str, code: str,
                 kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.code, self.kind = status, code, kind

    def response(self) -> web.Response:
        return web.json_response(
            {"error": {"message": str(self), "type": self.kind, "code": self.code}},
            status=self.status)


class Frontend:
    def __init__(self, prefill, decode, model: str, *, limits: FrontendLimits = FrontendLimits(),
                 retries: int = 1) -> None:
        self.prefill, self.decode = prefill, decode  # Dynamo clients
        self.model, self.limits, self.retries = model, limits, retries

    def app(self) -> web.Application:
        app = web.Application(client_max_size=self.limits.max_body_bytes,
                              middlewares=[self._errors])
        app.router.add_get("/health", lambda r: web.json_response({"status": "ok"}))
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/v1/chat/completions", self._chat)
        return app

    @web.middleware
    async def _errors(self, request, handler):
        try:
            return await handler(request)
        except ApiError as e:
            return e.response()
        except web.HTTPRequestEntityTooLarge:
            return ApiError(413, f"request body is over {self.limits.max_body_bytes} bytes",
                            "body_too_large").response()

    async def _models(self, request) -> web.Response:
        return web.json_response({"object": "list", "data": [
            {"id": self.model, "object": "model", "owned_by": "mmhandoff", "created": 0}]})

    # ---- chat ----------------------------------------------------------------------------------
    async def _chat(self, request: web.Request) -> web.StreamResponse:
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise ApiError(400, "request body is not valid JSON", "invalid_json") from None
        if not isinstance(body, dict):
            raise ApiError(400, "request body must be a JSON object", "invalid_request")
        if body.get("model") != self.model:
            raise ApiError(404, f"model {body.get('model')!r} does not exist; this server serves "
                                f"{self.model!r}", "model_not_found")
        prefill_request = self._prefill_request(body)
        if body.get("stream"):
            return await self._stream(request, prefill_request)
        text, finish, usage = "", None, None
        async for delta, finish, usage in self._answer(prefill_request):
            text += delta
        return web.json_response({
            "id": prefill_request.request_id, "object": "chat.completion",
            "created": int(time.time()), "model": self.model,
            "choices": [{"index": 0, "finish_reason": finish,
                         "message": {"role": "assistant", "content": text}}],
            "usage": usage})

    async def _stream(self, request, prefill_request) -> web.StreamResponse:
        answer = self._answer(prefill_request)
        first = await anext(answer)  # errors before the first token still get a 4xx/5xx
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                               "Cache-Control": "no-cache"})
        await response.prepare(request)
        base = {"id": prefill_request.request_id, "object": "chat.completion.chunk",
                "created": int(time.time()), "model": self.model}

        async def send(delta, finish, usage):
            chunk = dict(base, choices=[{"index": 0, "delta": {"content": delta} if delta else {},
                                         "finish_reason": finish}])
            if usage:
                chunk["usage"] = usage
            await response.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")

        await send(*first)
        async for item in answer:
            await send(*item)
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    async def _answer(self, prefill_request) -> AsyncIterator[tuple[str, str | None, dict | None]]:
        """(text delta, finish reason, usage) items; retries through prefill on fail-closed."""
        for attempt in range(self.retries + 1):
            sent = 0
            try:
                handoff = await self._handoff(prefill_request)
                async for chunk in call(self.decode, handoff):
                    sent += len(chunk["token_ids"])
                    usage = None
                    if chunk.get("finish_reason"):
                        prompt = len(handoff["token_ids"])
                        usage = {"prompt_tokens": prompt, "completion_tokens": sent,
                                 "total_tokens": prompt + sent}
                    yield chunk["text"], chunk.get("finish_reason"), usage
                return
            except RemoteError as e:
                if e.code == "kv_coverage" and not sent and attempt < self.retries:
                    continue
                status = 503 if e.code in ("kv_coverage", "prefill_failed") else 400
                raise ApiError(status, str(e), e.code,
                               "server_error" if status == 503 else "invalid_request_error") from None

    async def _handoff(self, prefill_request) -> dict:
        answers = [a async for a in call(self.prefill, msgspec.to_builtins(prefill_request))]
        return answers[0]["handoff"]

    # ---- request checks (nothing starts before they pass) -------------------------------------
    def _prefill_request(self, body: dict) -> PrefillRequest:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise ApiError(400, "messages must be a non-empty list", "invalid_messages")
        images = 0
        for message in messages:
            content = message.get("content") if isinstance(message, dict) else None
            if not isinstance(message, dict) or message.get("role") not in (
                    "system", "user", "assistant"):
                raise ApiError(400, "each message needs a role: system, user or assistant",
                               "invalid_messages")
            for part in content if isinstance(content, list) else ():
                if isinstance(part, dict) and part.get("type") == "image_url":
                    images += 1
                    url = part.get("image_url")
                    self._check_image(url.get("url") if isinstance(url, dict) else url)
        if images > self.limits.max_images:
            raise ApiError(400, f"{images} images; at most {self.limits.max_images} per request",
                           "too_many_images")
        max_tokens = body.get("max_completion_tokens") or body.get("max_tokens") or 16
        if not isinstance(max_tokens, int) or not 1 <= max_tokens <= self.limits.max_tokens:
            raise ApiError(400, f"max_tokens must be an integer in [1, {self.limits.max_tokens}]",
                           "invalid_max_tokens")
        try:
            sampling = Sampling(max_tokens=max_tokens,
                                temperature=float(body.get("temperature", 1.0)),
                                top_p=float(body.get("top_p", 1.0)), seed=body.get("seed"))
        except (TypeError, ValueError):
            raise ApiError(400, "temperature and top_p must be numbers", "invalid_sampling") from None
        return PrefillRequest(request_id=f"chatcmpl-{uuid.uuid4().hex}", messages=messages,
                              sampling=sampling)

    def _check_image(self, url: Any) -> None:
        if not isinstance(url, str) or not url:
            raise ApiError(400, "image_url needs a url", "invalid_image")
        if url.startswith(("http://", "https://")):
            raise ApiError(400, "image URLs are not supported yet; send a data URI",
                           "image_url_not_supported")
        try:
            data = data_uri_bytes(url, ImageLimits(max_bytes=self.limits.max_image_bytes))
        except ImageError as e:
            raise ApiError(413 if isinstance(e, ImageTooLarge) else 400, str(e), e.code) from None
        try:
            with Image.open(io.BytesIO(data)) as probe:  # reads the header only
                width, height = probe.size
        except (UnidentifiedImageError, OSError):
            raise ApiError(400, "image data is not a readable image", "invalid_image") from None
        if width * height > self.limits.max_image_pixels:
            raise ApiError(413, f"image is {width}x{height} pixels; the limit is "
                                f"{self.limits.max_image_pixels}", "image_too_large")


def main(argv: list[str] | None = None) -> int:
    """`python -m components.frontend`: serve HTTP once prefill and decode are discoverable."""
    import argparse
    import asyncio
    import signal
    import sys

    from components.runtime import client, runtime

    p = argparse.ArgumentParser(prog="python -m components.frontend")
    p.add_argument("--namespace", default="mmhandoff")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--model-name", default="tiny-llava", help="the model id clients ask for")
    p.add_argument("--wait-s", type=float, default=600, help="how long to wait for the workers")
    args = p.parse_args(argv)

    async def serve() -> int:
        rt = runtime(asyncio.get_running_loop())
        print(f"[frontend] waiting for {args.namespace}.prefill and .decode", file=sys.stderr,
              flush=True)
        prefill = await client(rt, f"{args.namespace}.prefill.generate", args.wait_s)
        decode = await client(rt, f"{args.namespace}.decode.generate", args.wait_s)
        runner = web.AppRunner(Frontend(prefill, decode, args.model_name).app())
        await runner.setup()
        await web.TCPSite(runner, args.host, args.port).start()
        print(f"[frontend] ready on http://{args.host}:{args.port}/v1", file=sys.stderr, flush=True)
        stop = asyncio.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            asyncio.get_running_loop().add_signal_handler(sig, stop.set)
        await stop.wait()
        await runner.cleanup()
        rt.shutdown()
        return 0

    return asyncio.run(serve())


if __name__ == "__main__":
    raise SystemExit(main())
