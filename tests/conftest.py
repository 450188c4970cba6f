"""Shared test harness: real vLLM engines (started once per session), real NIXL over loopback.

Engines are AsyncLLMs driven from one background event loop thread; tests submit coroutines to it
with a timeout, so a hung transfer fails a test instead of hanging the run.
"""

from __future__ import annotations

import asyncio
import base64
import io
import logging
import os
import threading
from dataclasses import dataclass
from typing import Any

# Nothing in the tests may reach another address: loopback only.
os.environ.setdefault("UCX_NET_DEVICES", "lo")
for _var in ("DYN_TCP_RPC_HOST", "DYN_TCP_RESPONSE_STREAM_HOST", "DYN_EVENT_PLANE_HOST"):
    os.environ.setdefault(_var, "127.0.0.1")
os.environ.pop("POD_IP", None)  # components bind their NIXL side channel to it when set
# Lets a test ask a worker process what its model holds (collective_rpc with a function).
os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
from hypothesis import settings  # noqa: E402
from PIL import Image  # noqa: E402

# Property tests draw the same examples on every run (a suite that passes or fails by chance is
# a bug); HYPOTHESIS_PROFILE=explore searches afresh, to find new failures on purpose.
settings.register_profile("ci", derandomize=True, database=None)
settings.register_profile("explore", derandomize=False)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def free_port() -> int:
    """Never from the ephemeral range, where vLLM's own port picks can take it first
    (mmhandoff.plane.ports)."""
    from mmhandoff.plane.ports import free_port as take

    return take()


class Loop:
    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True, name="engines")
        self.thread.start()

    def run(self, coro, timeout: float = 120.0) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        async def cancel_the_rest():  # e.g. a prefill worker's sweep of unclaimed handoffs
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        self.run(cancel_the_rest(), timeout=10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=5)


@pytest.fixture
def mmhandoff_log(caplog, monkeypatch):
    """What mmhandoff's loggers write during the test (mmhandoff.logs.setup, which a component's
    main calls, keeps them from the root logger, where caplog listens)."""
    monkeypatch.setattr(logging.getLogger("mmhandoff"), "propagate", True)
    caplog.set_level(logging.INFO)
    return caplog


@pytest.fixture(scope="session")
def loop():
    lp = Loop()
    yield lp
    lp.close()


@pytest.fixture(scope="session")
def tiny_model() -> str:
    from mmhandoff.models.tiny import ensure_tiny_model

    return str(ensure_tiny_model())


@dataclass
class Engines:
    prefill: Any
    decode: Any
    full: Any  # the whole VLM as KV consumer: aggregated reference and full-media decode arm
    prefill_events: Any
    decode_events: Any
    lease_s: int
    prefill_load: Any
    decode_load: Any


def start(loop: Loop, spec, load=None) -> Any:
    from mmhandoff.vllm_adapter import start_engine

    async def _start():
        return start_engine(spec, load)

    return loop.run(_start(), timeout=300)


@pytest.fixture(scope="session")
def engines(loop, tiny_model):
    from mmhandoff.vllm_adapter import EngineLoad, EngineSpec
    from mmhandoff.vllm_adapter.kv_events import KVEventSubscriber

    lease_s = 8
    prefill_load, decode_load = EngineLoad(), EngineLoad()
    p_events, d_events = free_port(), free_port()
    common = dict(model=tiny_model, dtype="float32", kv_cache_gib=1)
    prefill = start(loop, EngineSpec(role="prefill", cpu_cores="0", nixl_port=free_port(),
                                     kv_lease_s=lease_s, kv_events_endpoint=f"tcp://*:{p_events}",
                                     **common), prefill_load)
    decode = start(loop, EngineSpec(role="decode", cpu_cores="1", nixl_port=free_port(),
                                    kv_events_endpoint=f"tcp://*:{d_events}", **common),
                   decode_load)
    full = start(loop, EngineSpec(role="full_media_decode", cpu_cores="1", nixl_port=free_port(),
                                  **common))
    e = Engines(prefill, decode, full,
                KVEventSubscriber(f"tcp://127.0.0.1:{p_events}"),
                KVEventSubscriber(f"tcp://127.0.0.1:{d_events}"), lease_s, prefill_load,
                decode_load)
    yield e
    for sub in (e.prefill_events, e.decode_events):
        sub.close()
    for engine in (prefill, decode, full):
        engine.shutdown()


@pytest.fixture(scope="session")
def dynamo_rt(loop, tmp_path_factory):
    """One Dynamo runtime for the session (file discovery, TCP request plane, loopback)."""
    from mmhandoff.plane.runtime import runtime

    os.environ["DYN_FILE_KV"] = str(tmp_path_factory.mktemp("dyn-discovery"))

    async def up():
        return runtime(asyncio.get_running_loop(), discovery="file", request_plane="tcp")

    rt = loop.run(up())
    yield rt
    rt.shutdown()


@pytest.fixture(scope="session")
def dynamo(loop, engines, dynamo_rt):
    from mmhandoff.decode.worker import ERRORS as DECODE_ERRORS
    from mmhandoff.decode.worker import DecodeWorker
    from mmhandoff.plane.runtime import client, serve
    from mmhandoff.prefill.worker import ERRORS, PrefillWorker

    prefill, decode = PrefillWorker(engines.prefill), DecodeWorker(engines.decode)

    async def up():
        serve(dynamo_rt, "mmhtest.prefill.generate", prefill.handle, ERRORS)
        serve(dynamo_rt, "mmhtest.decode.generate", decode.handle, DECODE_ERRORS)
        return await client(dynamo_rt, "mmhtest.prefill.generate"), await client(
            dynamo_rt, "mmhtest.decode.generate")

    p, d = loop.run(up())
    yield prefill, decode, p, d


# ---- images ----------------------------------------------------------------------------------------
def engine_cpu_s(engine) -> float:
    """CPU seconds used so far by an engine's core process and its model workers."""
    import psutil

    (core_pid,) = engine.core_pids()
    core = psutil.Process(core_pid)
    return sum(sum(p.cpu_times()[:2]) for p in (core, *core.children(recursive=True)))


def make_image(width: int, height: int, seed: int) -> Image.Image:
    """A photo-like picture (smooth gradients plus noise) so JPEG sizes are realistic."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    base = np.stack([(x / width) * 255, (y / height) * 255, ((x + y) / (width + height)) * 255], -1)
    noise = rng.normal(0, 24, size=(height, width, 3)).astype(np.float32)
    tint = rng.uniform(0.3, 1.0, size=3).astype(np.float32)
    return Image.fromarray(np.clip(base * tint + noise, 0, 255).astype(np.uint8))


def encode(image: Image.Image, fmt: str = "PNG") -> bytes:
    buf = io.BytesIO()
    image.save(buf, format=fmt, quality=90) if fmt == "JPEG" else image.save(buf, format=fmt)
    return buf.getvalue()


def data_uri(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def chat(text: str, *uris: str) -> list:
    from mmhandoff.wire.messages import user

    return [user(text, *uris)]


def make_video(width: int, height: int, frames: int, fps: float, seed: int) -> bytes:
    """An MPEG-4 clip written by OpenCV (benchmarks.common.mp4): frames that differ, fixed bytes
    per seed."""
    from benchmarks.common import mp4

    return mp4(width, height, frames, fps, seed)


def video_chat(text: str, *parts: tuple[str, bytes]) -> list:
    """One user turn: ("image" | "video", bytes) parts as data URIs in order, then the text."""
    from mmhandoff.wire.messages import (
        ChatMessage,
        ImagePart,
        ImageURL,
        TextPart,
        VideoPart,
        VideoURL,
    )

    content = [ImagePart(ImageURL(data_uri(blob))) if kind == "image"
               else VideoPart(VideoURL(data_uri(blob, "video/mp4"))) for kind, blob in parts]
    return [ChatMessage("user", [*content, TextPart(text)])]


# ---- a loopback HTTP server for image URLs -------------------------------------------------------
IMAGE_SERVER_PNG = encode(make_image(120, 90, 65))


def serve_app(loop: Loop, app_runner) -> str:
    """Start an aiohttp AppRunner on a free loopback port (on the test loop); its base URL."""
    port = free_port()

    async def up():
        from aiohttp import web

        await app_runner.setup()
        await web.TCPSite(app_runner, "127.0.0.1", port).start()

    loop.run(up())
    return f"http://127.0.0.1:{port}"


@pytest.fixture(scope="module")
def image_server(loop):
    """A loopback HTTP server with the cases an image fetch meets."""
    from aiohttp import web

    async def slow(request):
        await asyncio.sleep(30)  # longer than the fetch time limit under test
        return web.Response(body=IMAGE_SERVER_PNG)

    def answer(make):
        async def handler(request):
            return make()
        return handler

    def redirect(location):
        async def handler(request):
            raise web.HTTPFound(location)
        return handler

    app = web.Application()
    app.router.add_get("/img.png", answer(lambda: web.Response(body=IMAGE_SERVER_PNG,
                                                               content_type="image/png")))
    app.router.add_get("/big", answer(lambda: web.Response(body=b"\0" * (3 << 20))))
    app.router.add_get("/900k", answer(lambda: web.Response(body=b"\0" * (900 << 10))))
    app.router.add_get("/text", answer(lambda: web.Response(text="not an image")))
    app.router.add_get("/slow", slow)
    app.router.add_get("/to-img", redirect("/img.png"))
    app.router.add_get("/to-metadata", redirect("http://169.254.169.254/latest/meta-data/"))
    runner = web.AppRunner(app, handler_cancellation=True)  # a client gone ends /slow at once
    url = serve_app(loop, runner)
    yield url
    loop.run(runner.cleanup())


# ---- tiers --------------------------------------------------------------------------------------
TIERS = ("unit", "engine", "graph", "gpu")  # gpu: selected only on a GPU host


def pytest_collection_modifyitems(config, items):
    """Every test has exactly one tier marker; within a run, tiers go in order (unit first)."""
    untiered = [i.nodeid for i in items if sum(1 for t in TIERS if i.get_closest_marker(t)) != 1]
    if untiered:
        raise pytest.UsageError(f"tests without exactly one tier marker {TIERS}: {untiered}")
    rank = {t: n for n, t in enumerate(TIERS)}
    items.sort(key=lambda i: next(rank[t] for t in TIERS if i.get_closest_marker(t)))
