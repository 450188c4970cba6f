"""Reading an OpenAI request body into a PrefillRequest: every check the frontend makes before
anything starts. Each refusal is an `ApiError` (status, OpenAI-style code); nothing is sent on.

Messages are parsed here, once, into typed parts (mmhandoff.wire.messages: text, image_url and
video_url parts only), so a client cannot pass any other form through (e.g. a server-side file
path). Image and video URLs are fetched here, behind mmhandoff.media.fetch's guard, and travel on
as data URIs: workers never open a connection for a client. A video is probed (its container's
header: size, frames, rate) against the limits; its frames are decoded by prefill only.
"""

from __future__ import annotations

import asyncio
import base64
import io
import math
import uuid
from dataclasses import dataclass, field, replace
from typing import Any

from PIL import Image, UnidentifiedImageError

from mmhandoff.media.fetch import ByteBudget, FetchPolicy, ImageFetcher
from mmhandoff.media.images import (
    ImageError,
    ImageLimits,
    ImageTooLarge,
    data_uri_bytes,
    peek_data_uri,
)
from mmhandoff.media.videos import VideoLimits, VideoTooLarge, check_video, probe_video
from mmhandoff.wire.handoff import Sampling, Structured
from mmhandoff.wire.messages import (
    ChatMessage,
    ImagePart,
    ImageURL,
    PrefillRequest,
    TextPart,
    VideoPart,
    VideoURL,
)


OFF_LOOP_CHARS = 1 << 20  # a request body longer than this is parsed in a thread


@dataclass(frozen=True)
class FrontendLimits:
    max_body_bytes: int = 48 * 1024 * 1024
    max_image_bytes: int = 32 * 1024 * 1024
    max_image_pixels: int = 50_000_000
    max_images: int = 8
    video: VideoLimits = VideoLimits()  # each video's bytes, frame size, frames and duration
    max_videos: int = 2
    max_tokens: int = 4096
    max_prompt_chars: int = 1_000_000


class ApiError(Exception):
    def __init__(self, status: int, message: str, code: str,
                 kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.code, self.kind = status, code, kind


def _probe(data: bytes) -> tuple[int, int, str | None] | None:
    """Width, height and format from an image's header (pixels are not decoded), or None."""
    try:
        with Image.open(io.BytesIO(data)) as image:
            return *image.size, image.format
    except Image.DecompressionBombError as e:  # over twice PIL's own pixel limit
        raise ApiError(413, f"image is too large: {e}", "image_too_large") from None
    except (UnidentifiedImageError, OSError):
        return None


_VIDEO_FETCH_CODES = {"image_url_forbidden": "video_url_forbidden",
                      "image_fetch_failed": "video_fetch_failed",
                      "image_too_large": "video_too_large"}


def _image_error(e: ImageError) -> ApiError:
    return ApiError(413 if isinstance(e, ImageTooLarge) else 400, str(e), e.code)


@dataclass
class RequestReader:
    model: str
    limits: FrontendLimits = field(default_factory=FrontendLimits)
    fetch_policy: FetchPolicy = field(default_factory=FetchPolicy)
    # fields a client sends that are neither OpenAI's nor vLLM's, ignored instead of refused
    # (the frontend's --ignore-fields)
    ignored_fields: frozenset[str] = frozenset()

    def __post_init__(self) -> None:  # one image-size limit, whatever way the image comes
        self.fetcher = ImageFetcher(replace(self.fetch_policy,
                                            max_bytes=self.limits.max_image_bytes))
        self.video_fetcher = ImageFetcher(replace(self.fetch_policy,
                                                  max_bytes=self.limits.video.max_bytes),
                                          what="video")

    # ---- the two request kinds ----------------------------------------------------------------
    async def chat(self, body: Any) -> PrefillRequest:
        self._check_model(body, "chat")
        sampling, salt = self._sampling(body, chat=True), _cache_salt(body)  # before any fetch
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise ApiError(400, "messages must be a non-empty list", "invalid_messages")
        typed = [self._message(m) for m in messages]
        images = [p for m in typed for p in m.parts() if isinstance(p, ImagePart)]
        videos = [p for m in typed for p in m.parts() if isinstance(p, VideoPart)]
        if len(images) > self.limits.max_images:
            raise ApiError(400, f"{len(images)} images; at most {self.limits.max_images} per "
                                "request", "too_many_images")
        if len(videos) > self.limits.max_videos:
            raise ApiError(400, f"{len(videos)} videos; at most {self.limits.max_videos} per "
                                "request", "too_many_videos")
        # fetched media together may take what a body could carry (each: its own limit)
        budget = ByteBudget(self.limits.max_body_bytes)
        uris = await asyncio.gather(*(self._image(p.image_url.url, budget) for p in images),
                                    *(self._video(p.video_url.url, budget) for p in videos))
        for part, uri in zip(images, uris):  # media parts now carry checked data URIs
            part.image_url.url = uri
        for part, uri in zip(videos, uris[len(images):]):
            part.video_url.url = uri
        return PrefillRequest(request_id=f"chatcmpl-{uuid.uuid4().hex}", messages=typed,
                              sampling=sampling, cache_salt=salt)

    async def completion(self, body: Any) -> PrefillRequest:
        self._check_model(body, "completions")
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1:
            prompt = prompt[0]
        if not isinstance(prompt, str) or not prompt:
            raise ApiError(400, "prompt must be one non-empty string (images: use "
                                "/v1/chat/completions)", "invalid_prompt")
        if len(prompt) > self.limits.max_prompt_chars:
            raise ApiError(400, f"prompt is over {self.limits.max_prompt_chars} characters",
                           "prompt_too_long")
        return PrefillRequest(request_id=f"cmpl-{uuid.uuid4().hex}", prompt=prompt,
                              sampling=self._sampling(body, chat=False),
                              cache_salt=_cache_salt(body))

    # ---- pieces -------------------------------------------------------------------------------
    def _check_model(self, body: Any, api: str) -> None:
        if not isinstance(body, dict):
            raise ApiError(400, "request body must be a JSON object", "invalid_request")
        if body.get("model") != self.model:
            raise ApiError(404, f"model {body.get('model')!r} does not exist; this server serves "
                                f"{self.model!r}", "model_not_found")
        unknown = sorted(set(body) - FIELDS[api] - self.ignored_fields)
        if unknown:
            raise ApiError(400, f"unknown parameter{'s' if len(unknown) > 1 else ''} "
                                f"{', '.join(map(repr, unknown))} for /v1/{api} (a vendor field "
                                "to ignore: the frontend's --ignore-fields)", "unknown_parameter")
        _refuse_unapplied(body)

    def _message(self, message: Any) -> ChatMessage:
        if not isinstance(message, dict) or message.get("role") not in (
                "system", "user", "assistant"):
            raise ApiError(400, "each message needs a role: system, user or assistant",
                           "invalid_messages")
        content = message.get("content")
        if isinstance(content, str):
            return ChatMessage(message["role"], content)
        if not isinstance(content, list):
            raise ApiError(400, "message content must be a string or a list of parts",
                           "invalid_messages")
        return ChatMessage(message["role"], [self._part(p) for p in content])

    @staticmethod
    def _part(part: Any) -> TextPart | ImagePart | VideoPart:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text" and isinstance(part.get("text"), str):
            return TextPart(part["text"])
        if kind in ("image_url", "video_url"):
            media = part.get(kind)
            if not isinstance(media, dict):  # OpenAI's shape (vLLM's for video); not a string
                raise ApiError(400, f'{kind} must be an object: {{"url": "data:..." or '
                                    '"https://..."}', "invalid_content_part")
            url = media.get("url")
            if not isinstance(url, str) or not url:
                raise ApiError(400, f"{kind} needs a url",
                               "invalid_image" if kind == "image_url" else "invalid_video")
            return ImagePart(ImageURL(url)) if kind == "image_url" else VideoPart(VideoURL(url))
        raise ApiError(400, f"unsupported content part {kind!r}: text, image_url and video_url "
                            "are supported", "invalid_content_part")

    async def _image(self, url: str, budget: ByteBudget) -> str:
        """A checked data URI for an image given as a data URI or an http(s) URL."""
        limits = ImageLimits(max_bytes=self.limits.max_image_bytes)
        try:
            if url.startswith("data:"):  # checked whole (12 MP: ~0.3 ms); the header read
                size, data = peek_data_uri(url, limits)
            elif url.startswith(("http://", "https://")):
                data = await self.fetcher.fetch(url, budget)
                size = len(data)
            else:
                raise ApiError(400, "image_url must be a data URI or an http(s) URL",
                               "invalid_image_url")
            header = _probe(data)
            if header is None and len(data) < size:  # a header longer than the head we took
                header = _probe(data_uri_bytes(url, limits))
        except ImageError as e:
            raise _image_error(e) from None
        if header is None:
            raise ApiError(400, "image data is not a readable image", "invalid_image")
        width, height, fmt = header
        if width * height > self.limits.max_image_pixels:
            raise ApiError(413, f"image is {width}x{height} pixels; the limit is "
                                f"{self.limits.max_image_pixels}", "image_too_large")
        if url.startswith("data:"):
            return url
        mime = Image.MIME.get(fmt or "", "application/octet-stream")
        return f"data:{mime};base64,{base64.b64encode(data).decode()}"

    async def _video(self, url: str, budget: ByteBudget) -> str:
        """A checked data URI for a video given as a data URI or an http(s) URL: its container
        probed (no frame decoded) against the size, frame and duration limits."""
        limits = self.limits.video
        try:
            if url.startswith("data:"):
                if not url.startswith("data:video/"):
                    raise ApiError(400, "a video data URI must be data:video/<type>;base64,...",
                                   "invalid_video_url")
                try:  # (up to 32 MiB of base64: off the event loop, as the probe)
                    data = await asyncio.to_thread(data_uri_bytes, url,
                                                   ImageLimits(max_bytes=limits.max_bytes))
                except ImageTooLarge:
                    raise VideoTooLarge(f"video is over the {limits.max_bytes}-byte limit") \
                        from None
            elif url.startswith(("http://", "https://")):
                data = await self.video_fetcher.fetch(url, budget)
            else:
                raise ApiError(400, "video_url must be a data URI or an http(s) URL",
                               "invalid_video_url")
            check_video(await asyncio.to_thread(probe_video, data), limits)
        except ImageError as e:
            error = _image_error(e)
            error.code = _VIDEO_FETCH_CODES.get(error.code, error.code)  # (the shared fetcher's)
            raise error from None
        if url.startswith("data:"):
            return url
        return f"data:video/mp4;base64,{base64.b64encode(data).decode()}"

    def _sampling(self, body: dict, chat: bool) -> Sampling:
        max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
        max_tokens = 16 if max_tokens is None else max_tokens
        if type(max_tokens) is not int or not 1 <= max_tokens <= self.limits.max_tokens:
            raise ApiError(400, f"max_tokens must be an integer in [1, {self.limits.max_tokens}]",
                           "invalid_max_tokens")
        seed, ignore_eos = body.get("seed"), body.get("ignore_eos", False)  # vLLM's extension
        if seed is not None and type(seed) is not int or type(ignore_eos) is not bool:
            raise ApiError(400, "seed must be an integer and ignore_eos a boolean",
                           "invalid_sampling")
        temperature, top_p = body.get("temperature", 1.0), body.get("top_p", 1.0)
        if not all(_number(v) for v in (temperature, top_p)):
            raise ApiError(400, "temperature and top_p must be numbers", "invalid_sampling")
        if not (math.isfinite(temperature) and temperature >= 0):  # vLLM's own rule
            raise ApiError(400, "temperature must be a finite number >= 0", "invalid_sampling")
        if not 0 < top_p <= 1:  # NaN fails this too
            raise ApiError(400, "top_p must be in (0, 1]", "invalid_sampling")
        stop_ids = body.get("stop_token_ids") or []  # vLLM's extension
        if (not isinstance(stop_ids, list) or len(stop_ids) > MAX_STOP_TOKEN_IDS
                or any(type(t) is not int or t < 0 for t in stop_ids)):
            raise ApiError(400, f"stop_token_ids must be a list of at most {MAX_STOP_TOKEN_IDS} "
                                "token ids (integers >= 0)", "invalid_sampling")
        return Sampling(max_tokens=max_tokens, temperature=float(temperature),
                        top_p=float(top_p), seed=seed, ignore_eos=ignore_eos,
                        stop_token_ids=stop_ids, logprobs=_logprobs(body, chat),
                        structured=_structured(body), **_sampling_extras(body, max_tokens))


MAX_STOP_TOKEN_IDS = 64
MAX_STOP_STRINGS, MAX_STOP_CHARS = 16, 256
MAX_LOGPROBS = 20  # vLLM's default max_logprobs
MAX_LOGIT_BIAS = 300  # token ids a request may bias (OpenAI allows 300)
STRUCTURED_KINDS = ("json", "json_object", "regex", "choice")


def _structured_error(message: str) -> ApiError:
    return ApiError(400, message, "invalid_response_format")


def _structured(body: dict) -> Structured | None:
    """The structured-output constraint: OpenAI's `response_format` (json_object, json_schema)
    or vLLM's `structured_outputs` (one of json, json_object, regex, choice). A schema the engine cannot compile is refused by the engine, before
    any token (400 invalid_request)."""
    fmt, so = body.get("response_format"), body.get("structured_outputs")
    if fmt is not None and so is not None:
        raise _structured_error("set response_format or structured_outputs, not both")
    if fmt is not None:
        kind = fmt.get("type") if isinstance(fmt, dict) else None
        if kind not in ("text", "json_object", "json_schema"):
            raise _structured_error('response_format.type must be "text", "json_object" or '
                                    '"json_schema"')
        if kind == "text":
            return None
        if kind == "json_object":
            return Structured(json_object=True)
        spec = fmt.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise _structured_error("response_format json_schema needs json_schema.schema, "
                                    "a JSON schema object")
        return Structured(json=schema)
    if so is None:
        return None
    if not isinstance(so, dict):
        raise _structured_error("structured_outputs must be an object")
    unknown = set(so) - set(STRUCTURED_KINDS)
    if unknown:  # grammar, structural_tag; disable_any_whitespace: vLLM 0.31 applies only the
        # engine's setting, so a request's would be silently ignored
        raise ApiError(400, f"structured_outputs {', '.join(sorted(unknown))} is not supported "
                            f"by this server yet (supported: {', '.join(STRUCTURED_KINDS)})",
                       "unsupported_parameter")
    given = {k: so[k] for k in STRUCTURED_KINDS if so.get(k) not in (None, False)}
    if len(given) != 1:
        raise _structured_error(f"structured_outputs needs exactly one of "
                                f"{', '.join(STRUCTURED_KINDS)}")
    (kind, value), = given.items()
    valid = {"json": isinstance(value, dict), "json_object": value is True,
             "regex": isinstance(value, str) and value != "",
             "choice": isinstance(value, list) and bool(value)
             and all(isinstance(c, str) for c in value)}[kind]
    if not valid:
        raise _structured_error(f"structured_outputs.{kind} must be "
                                + {"json": "a JSON schema object", "json_object": "true",
                                   "regex": "a non-empty string",
                                   "choice": "a non-empty list of strings"}[kind])
    return Structured(**{kind: value})


MAX_CHOICES = 16


def choices(body: Any, api: str) -> tuple[int, bool]:
    """(`n`, completions' `echo`): how many answers to the one prompt (vLLM's parallel
    sampling: the i-th sampled with seed + i when a seed is set), and whether each answer's text
    starts with the prompt."""
    if not isinstance(body, dict):
        return 1, False
    n = body.get("n")
    n = 1 if n is None else n
    if type(n) is not int or not 1 <= n <= MAX_CHOICES:
        raise ApiError(400, f"n must be an integer in [1, {MAX_CHOICES}]", "invalid_sampling")
    echo = body.get("echo")
    if echo is not None and type(echo) is not bool:
        raise ApiError(400, "echo must be a boolean", "invalid_sampling")
    if echo and api == "chat":  # vLLM's chat echo repeats the last message: another meaning
        raise ApiError(400, "echo is not supported by this server for chat completions yet",
                       "unsupported_parameter")
    return n, bool(echo)


def _logprobs(body: dict, chat: bool) -> int | None:
    """Sampling.logprobs: how many top tokens each answer token comes with (0: its own logprob
    only), None: none asked. Chat: `logprobs: true` and `top_logprobs: k`; completions:
    `logprobs: k`."""
    if chat:
        asked, top = body.get("logprobs"), body.get("top_logprobs")
        if asked is not None and type(asked) is not bool:
            raise ApiError(400, "logprobs must be a boolean", "invalid_sampling")
        if top is not None and (type(top) is not int or not 0 <= top <= MAX_LOGPROBS):
            raise ApiError(400, f"top_logprobs must be an integer in [0, {MAX_LOGPROBS}]",
                           "invalid_sampling")
        if top and not asked:
            raise ApiError(400, "top_logprobs needs logprobs: true", "invalid_sampling")
        return (top or 0) if asked else None
    asked = body.get("logprobs")
    if asked is not None and (type(asked) is not int or not 0 <= asked <= MAX_LOGPROBS):
        raise ApiError(400, f"logprobs must be an integer in [0, {MAX_LOGPROBS}]",
                       "invalid_sampling")
    return asked


def _sampling_extras(body: dict, max_tokens: int) -> dict[str, Any]:
    """top_k, min_p, the penalties, stop strings, logit_bias and min_tokens, under vLLM's own rules
    (SamplingParams' checks), so that a value vLLM would refuse is a 400 here, before any
    work."""
    out: dict[str, Any] = {}
    top_k = body.get("top_k")
    if top_k is not None:
        if type(top_k) is not int or top_k < -1:
            raise ApiError(400, "top_k must be an integer: -1 or 0 (off), or at least 1",
                           "invalid_sampling")
        out["top_k"] = max(top_k, 0)
    floats = {  # name: (valid, rule as the client reads it)
        "min_p": (lambda v: 0 <= v <= 1, "in [0, 1]"),
        "repetition_penalty": (lambda v: 0 < v <= 2, "in (0, 2]"),
        "presence_penalty": (lambda v: -2 <= v <= 2, "in [-2, 2]"),
        "frequency_penalty": (lambda v: -2 <= v <= 2, "in [-2, 2]"),
    }
    for name, (valid, rule) in floats.items():
        value = body.get(name)
        if value is None:
            continue
        if not (_number(value) and valid(value)):  # NaN fails every rule
            raise ApiError(400, f"{name} must be a number {rule}", "invalid_sampling")
        out[name] = float(value)
    stop = body.get("stop")
    if isinstance(stop, str):
        stop = [stop] if stop else []  # "" asks for nothing, as in vLLM
    if stop is not None:
        if (not isinstance(stop, list) or len(stop) > MAX_STOP_STRINGS
                or any(not isinstance(x, str) or not 0 < len(x) <= MAX_STOP_CHARS
                       for x in stop)):
            raise ApiError(400, f"stop must be a string or a list of at most {MAX_STOP_STRINGS} "
                                f"non-empty strings of at most {MAX_STOP_CHARS} characters",
                           "invalid_sampling")
        out["stop"] = stop
    include = body.get("include_stop_str_in_output")  # vLLM's extension
    if include is not None:
        if type(include) is not bool:
            raise ApiError(400, "include_stop_str_in_output must be a boolean",
                           "invalid_sampling")
        out["include_stop_str_in_output"] = include
    bias = body.get("logit_bias")
    if bias is not None:
        if not isinstance(bias, dict) or len(bias) > MAX_LOGIT_BIAS or any(
                not (isinstance(t, str) and t.isascii() and t.isdigit() and len(t) <= 9)
                or not (_number(b) and math.isfinite(b)) for t, b in bias.items()):
            raise ApiError(400, f"logit_bias must map at most {MAX_LOGIT_BIAS} token ids "
                                "(decimal strings) to finite numbers", "invalid_sampling")
        if bias:  # as vLLM: each bias clamped to [-100, 100]
            out["logit_bias"] = {str(int(t)): min(100.0, max(-100.0, float(b)))
                                 for t, b in bias.items()}
    min_tokens = body.get("min_tokens")
    if min_tokens is not None:
        if type(min_tokens) is not int or not 0 <= min_tokens <= max_tokens:
            raise ApiError(400, "min_tokens must be an integer in [0, max_tokens]",
                           "invalid_sampling")
        out["min_tokens"] = min_tokens
    return out


# OpenAI and vLLM parameters mmhandoff does not apply yet, with the values that ask for nothing.
# A request that sets one to anything else is refused: answering as if it had not asked (no stop
# applied, one choice for n=2, no JSON for a schema) looks right and is wrong. tools: vLLM itself
# refuses them unless a tool parser is configured.
UNAPPLIED: dict[str, tuple] = {
    "best_of": (1,), "prompt_logprobs": (0,),
    "guided_json": (), "guided_regex": (), "guided_choice": (),
    "guided_grammar": (), "tools": ([],), "tool_choice": ("none",), "functions": ([],),
    "function_call": ("none",), "suffix": ("",),
}


# Every field a request may carry: what is applied (docs/api.md), what is refused unless neutral
# (UNAPPLIED), and `user` (no effect, as in vLLM). Any other is refused with 400
# `unknown_parameter` naming it: a misspelt parameter (`max_token`, `temprature`) would otherwise
# be answered as if it had not been asked.
_COMMON_FIELDS = frozenset({
    "model", "stream", "stream_options", "n", "echo", "user", "cache_salt", "seed",
    "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "min_p",
    "min_tokens", "ignore_eos", "stop", "stop_token_ids", "include_stop_str_in_output",
    "repetition_penalty", "presence_penalty", "frequency_penalty", "logit_bias", "logprobs",
    "response_format", "structured_outputs", *UNAPPLIED})
FIELDS = {"chat": _COMMON_FIELDS | {"messages", "top_logprobs"},
          "completions": _COMMON_FIELDS | {"prompt"}}


def _neutral(value: Any, neutral: tuple) -> bool:
    if value is None:
        return True
    for n in neutral:  # 0 and 0.0 alike; True is not 1
        if isinstance(n, (int, float)) and not isinstance(n, bool):
            if _number(value) and value == n:
                return True
        elif type(value) is type(n) and value == n:
            return True
    return False


def _refuse_unapplied(body: dict) -> None:
    for name, neutral in UNAPPLIED.items():
        if name in body and not _neutral(body[name], neutral):
            hint = f" (leave it out or at {neutral[0]!r})" if neutral else " (leave it out)"
            raise ApiError(400, f"{name} is not supported by this server yet: it would be "
                                f"ignored{hint}", "unsupported_parameter")


@dataclass(frozen=True)
class StreamOptions:
    """How an answer is sent, with OpenAI's (and vLLM's) semantics: `stream`; with
    `include_usage`, a last chunk with `choices: []` and the usage, and `usage: null` on the
    others; with `continuous_usage_stats` too, the usage so far on every chunk."""

    stream: bool = False
    include_usage: bool = False
    continuous_usage_stats: bool = False


def stream_options(body: Any) -> StreamOptions:
    """The request's stream settings (a body that is no object: RequestReader refuses it)."""
    if not isinstance(body, dict):
        return StreamOptions()
    stream = body.get("stream", False)
    options = body.get("stream_options")
    if stream is None:
        stream = False
    if type(stream) is not bool:
        raise ApiError(400, "stream must be a boolean", "invalid_request")
    if options is None:
        return StreamOptions(stream)
    if not stream:
        raise ApiError(400, "stream_options can only be set when stream is true",
                       "invalid_request")
    if not isinstance(options, dict):
        raise ApiError(400, "stream_options must be an object", "invalid_request")
    flags = {name: options.get(name) for name in ("include_usage", "continuous_usage_stats")}
    if any(v is not None and type(v) is not bool for v in flags.values()):
        raise ApiError(400, "stream_options.include_usage and .continuous_usage_stats must be "
                            "booleans", "invalid_request")
    return StreamOptions(True, **{k: bool(v) for k, v in flags.items()})


MAX_CACHE_SALT_CHARS = 256


CLIENT_ID_CHARS = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789._:-")


def client_request_id(header: str | None) -> str | None:
    """The client's `X-Request-Id` (as vLLM's server takes it: the answer's id is
    `chatcmpl-<it>`, and the header comes back), checked: it appears in every component's logs
    and in the engines' request ids, so at most 128 of [A-Za-z0-9._:-]. None when not sent.
    Two requests in flight with one id are two requests (vLLM suffixes its internal ids)."""
    if header is None:
        return None
    if not 1 <= len(header) <= 128 or not set(header) <= CLIENT_ID_CHARS:
        raise ApiError(400, "X-Request-Id must be 1 to 128 characters of letters, digits and "
                            "._:-", "invalid_request_id")
    return header


def _cache_salt(body: dict) -> str | None:
    """vLLM's `cache_salt`: requests share prefix-cached KV only with requests of the same salt
    (one tenant's prompts cannot be probed by another's timing). It goes into every block hash,
    on prefill, decode and the router alike."""
    salt = body.get("cache_salt")
    if salt is None:
        return None
    if not isinstance(salt, str) or not 0 < len(salt) <= MAX_CACHE_SALT_CHARS:
        raise ApiError(400, f"cache_salt must be a non-empty string of at most "
                            f"{MAX_CACHE_SALT_CHARS} characters", "invalid_request")
    return salt


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
