"""Running one component as its own process: `python -m mmhandoff.<component> --model DIR ...`.

Starts the component's engine, serves its handler on the Dynamo runtime, reports ready on Dynamo's
system status server (mmhandoff.process.health) with its engine's load on the same server's
/metrics (mmhandoff.process.load_metrics), serves the blocks its engine holds to routers (a
second endpoint, `<component>.kv_blocks`: mmhandoff.process.block_feed), and on SIGINT/SIGTERM
(process.lifecycle) reports not ready, stops serving (in-flight requests finish), then shuts the
engine down. If the engine dies, it exits with `health.ENGINE_DEAD` (3).
"""

from __future__ import annotations

import argparse
import asyncio
import inspect
import ipaddress
import json
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, AsyncIterator, Awaitable, Callable, Protocol

from mmhandoff.plane.addresses import default_host
from mmhandoff.plane.handoff_keys import KEY_ENV, KEY_FILE_ENV, handoff_keys

log = logging.getLogger(__name__)


def parser(role: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=f"python -m mmhandoff.{role}")
    p.add_argument("--model", help="model folder, or a built-in tiny model: tiny-llava (the "
                   "default), tiny-qwen2-vl, tiny-qwen2.5-vl or tiny-qwen3-vl (built if "
                   "missing), or dummy:<shape> (a real architecture with random weights, for "
                   "GPUs: dummy:llava-1.5-7b)")
    p.add_argument("--namespace", default="mmhandoff")
    p.add_argument("--cpu-cores", help='CPU machines: cores for the engine, e.g. "0" or "0-1"')
    p.add_argument("--nixl-port", type=int, help="NIXL side-channel port of this engine")
    p.add_argument("--nixl-host", type=_ip, default=default_host(),
                   help="address of this engine's NIXL side channel (the KV handshake) that the "
                        "other engines reach; default $POD_IP (Kubernetes), else 127.0.0.1")
    p.add_argument("--kv-lease-s", type=int, help="prefill: how long unpulled KV is held")
    p.add_argument("--kv-deadline-s", type=float, default=30.0, help="decode: KV pull deadline")
    p.add_argument("--discovery", help='Dynamo discovery backend ("file", "etcd", ...)')
    p.add_argument("--request-plane", help='Dynamo request plane ("tcp" or "nats")')
    p.add_argument("--full-media", action="store_true",
                   help="benchmark arm: prefill hands decode the media; decode re-processes it")
    p.add_argument("--handoff-key-file", default=os.environ.get(KEY_FILE_ENV),
                   help="prefill signs each handoff with this key, decode refuses any handoff "
                        f"not signed with it (default ${KEY_FILE_ENV}; or the key itself in "
                        f"${KEY_ENV}, e.g. from a Kubernetes Secret)")
    if role == "prefill":
        p.add_argument("--router", default="none",
                       help="the router's endpoint (serve wires it from the graph), asked which "
                            "decode replica holds a prompt's KV; none: no bypass")
        p.add_argument("--bypass-max-tokens", type=int, default=0,
                       help="skip prefill's engine when a decode replica holds the prompt's KV "
                            "through its last image and at most this many prompt tokens are "
                            "left to compute (0: never; docs/routing.md)")
        from mmhandoff.prefill.worker import RELEASE_UNCLAIMED_S

        p.add_argument("--release-unclaimed-s", type=float, default=RELEASE_UNCLAIMED_S,
                       help="a signed handoff no decode has claimed this many seconds after it "
                            "was issued (its delivery lost) is revoked and its KV freed, instead "
                            "of held until --kv-lease-s ends (0: left to the lease)")
    if role in ("agg", "prefill"):
        from mmhandoff.engine.prompt import IMAGE_DECODES

        p.add_argument("--renderer-torch-threads", type=_count_or_auto(1), metavar="N|auto",
                       help="torch threads vLLM's renderer processes each image on (default: "
                            "vLLM's, one unless the process has OMP_NUM_THREADS; auto: up to 8, "
                            "no more than the process's cores); set once the engine is up")
        p.add_argument("--media-workers", type=_count_or_auto(0), default="auto", metavar="N|auto",
                       help="processes that decode, hash and presize images (media.pool; 0: "
                            "the worker's own threads); auto: half the process's cores (within "
                            "a cgroup CPU quota), at most 8, none on a host of fewer than 8 "
                            "cores")
        p.add_argument("--image-decode", choices=IMAGE_DECODES, default="exact",
                       help="exact: every pixel, the model's input is vLLM's own; draft: a JPEG "
                            "decoded at 1/2, 1/4 or 1/8 scale where the model's processor "
                            "resizes to a fixed short side anyway (LLaVA), ~2.5x less CPU for a "
                            "12 MP photo, the model's input off by up to ~0.09 (docs/gpu.md)")
    p.add_argument("--engine-arg", action="append", default=[], type=_engine_arg,
                   metavar="NAME=VALUE",
                   help="passed to vLLM's engine arguments as is, after mmhandoff's own (VALUE "
                        'is JSON when it parses, else a string), e.g. "gpu_memory_utilization='
                        '0.3"; repeat for more')
    return p


KV_PER_LAYER_ENV = "MMHANDOFF_GPU_KV_PER_LAYER"  # "1": vLLM's per-layer KV layout on GPUs


def _engine_arg(value: str) -> tuple[str, Any]:
    name, sep, raw = value.partition("=")
    if not sep or not name.isidentifier():
        raise argparse.ArgumentTypeError(f"expected NAME=VALUE, got {value!r}")
    try:
        return name, json.loads(raw)
    except ValueError:
        return name, raw


def _count_or_auto(minimum: int) -> Callable[[str], int | str]:
    """An argparse type: "auto", or an integer of at least `minimum`."""
    def parse(value: str) -> int | str:
        if value == "auto":
            return value
        try:
            n = int(value)
        except ValueError:
            n = minimum - 1
        if n < minimum:
            raise argparse.ArgumentTypeError(
                f"expected an integer of at least {minimum}, or auto; got {value!r}")
        return n

    return parse


def media_workers(args: argparse.Namespace) -> int:
    """The media processes `--media-workers` asks for (media.pool); 0 for a role without it."""
    from mmhandoff.media.pool import auto_workers

    count = getattr(args, "media_workers", 0)
    return auto_workers() if count == "auto" else count


def spawn_media_pool(args: argparse.Namespace):
    """The media processes the command line asks for, spawned (media.pool), or None."""
    count = media_workers(args)
    if not count:
        return None
    from mmhandoff.media.pool import MediaPool

    return MediaPool(count).spawn()


def _ip(value: str) -> str:
    """An IP address (the side channel binds to it: a host name would not do)."""
    try:
        return str(ipaddress.ip_address(value))
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an IP address: {value!r}") from None


# Built-in tiny models by name (mmhandoff.models): a folder of that name, if any, comes first.
TINY_MODELS = {"tiny-llava": "llava", "tiny-qwen2-vl": "qwen2_vl", "tiny-qwen2.5-vl": "qwen2_5_vl",
               "tiny-qwen3-vl": "qwen3_vl"}
DUMMY_PREFIX = "dummy:"  # "dummy:llava-1.5-7b": a real shape, random weights (models/dummy.py)


def model_folder(model: str | None) -> str:
    """The folder `--model` names: a folder, a built-in tiny model (built if missing), or
    `dummy:<shape>` (a real architecture's config without weights, written if missing)."""
    from mmhandoff.models.tiny import ensure_tiny_model

    if model is not None and model.startswith(DUMMY_PREFIX) and not Path(model).exists():
        from mmhandoff.models.dummy import ensure_dummy_model

        try:
            return str(ensure_dummy_model(model[len(DUMMY_PREFIX):]))
        except ValueError as e:
            raise SystemExit(f"--model {model}: {e}") from None
    if model is not None and (model not in TINY_MODELS or Path(model).exists()):
        return model
    return str(ensure_tiny_model(arch=TINY_MODELS[model or "tiny-llava"]))


def engine_spec(args: argparse.Namespace, role: str, kv_events_endpoint: str | None = None):
    """The EngineSpec a component's command line asks for."""
    from mmhandoff.vllm_adapter import EngineSpec

    extra = dict(args.engine_arg)
    if (args.model or "").startswith(DUMMY_PREFIX):  # no weights to load: random ones, in bf16
        extra = {"load_format": "dummy", "dtype": "bfloat16", **extra}
    return EngineSpec(model=model_folder(args.model), role=role,
                      cpu_cores=args.cpu_cores, nixl_port=args.nixl_port,
                      nixl_host=args.nixl_host, kv_lease_s=args.kv_lease_s,
                      kv_events_endpoint=kv_events_endpoint, extra=extra,
                      renderer_torch_threads=getattr(args, "renderer_torch_threads", None),
                      # an environment variable, not a flag: every engine of a graph must
                      # agree (vLLM's NIXL handshake compares the layouts), so a YAML sets it
                      # once in its `env` (docs/gpu.md)
                      kv_blocks_across_layers=os.environ.get(KV_PER_LAYER_ENV) != "1")


@dataclass
class WorkerContext:
    """What a worker gets of its process besides its engine (`make_worker(engine, context)`)."""

    args: argparse.Namespace  # the component's command line
    rt: Any  # the Dynamo runtime: for workers that call other components
    # the process's kv_blocks feed: what each image key's prefix is in this engine's blocks, for
    # routers' placement (prefill.prefixes)
    publish_prefixes: Callable[[dict[str, list]], None]
    component: str = ""  # "<namespace>.<component>": where its endpoints are
    instance_id: Callable[[], int] = lambda: 0  # its Dynamo instance id now (may change)
    # the media processes `--media-workers` asks for, spawned before the engine started (they
    # import torch meanwhile); the worker makes them ready (`start`) and closes them
    media_pool: Any = None


class Worker(Protocol):
    """What the process needs of a worker: the endpoint's handler, and its own warm-up (after the
    engine's, before the worker reports ready: the first client's request as fast as the rest).
    A worker run with `side_endpoints` also answers `side_handler(name)`: that endpoint's
    handler and the error types it reports typed. A worker with a `close()` (it closes the media
    processes it was given) is closed after its engine."""

    def handle(self, request: dict) -> AsyncIterator[dict]: ...

    async def warm_up(self) -> None: ...


def run(role: str, spec_role: str | Callable, endpoint: str,
        make_worker: Callable[[Any, WorkerContext], Worker | Awaitable[Worker]],
        errors: tuple, argv: list[str] | None = None,
        side_endpoints: tuple[str, ...] = ()) -> int:
    """`spec_role`: the EngineSpec role, or a function of the parsed arguments giving it.
    `make_worker(engine, context)` (a coroutine function, or a plain one): the worker.
    `side_endpoints`: more endpoints of the component that the worker serves
    (`worker.side_handler(name)`), from before its main endpoint until the process stops."""
    args = parser(role).parse_args(argv)
    from mmhandoff import logs
    from mmhandoff.plane.runtime import run as run_loop
    from mmhandoff.vllm_adapter.plugins import fast_exit

    logs.setup()
    code = run_loop(_serve(args, spec_role, endpoint, make_worker, errors, side_endpoints))
    if fast_exit.enabled():
        # The engine and the runtime are down. The interpreter's finalization would scan the
        # whole vLLM and torch heap to free nothing (~3 s on 2 cores): end the process now.
        fast_exit.end_process(code)
    return code


async def _serve(args, spec_role, endpoint, make_worker, errors, side_endpoints) -> int:
    from mmhandoff.plane.runtime import runtime, serve
    from mmhandoff.process import block_feed
    from mmhandoff.process.health import ENGINE_DEAD, start_not_ready, watch_engine
    from mmhandoff.process.lifecycle import until_stopped
    from mmhandoff.process.load_metrics import publish_engine_load
    from mmhandoff.vllm_adapter import EngineLoad, start_engine

    events = block_feed.events_endpoint()
    spec = engine_spec(args, spec_role(args) if callable(spec_role) else spec_role, events)
    args.handoff_keys = handoff_keys(args)  # before the engine starts: a bad key fails at once
    start_not_ready()
    load = EngineLoad()
    t0 = time.monotonic()
    pool = spawn_media_pool(args)
    try:
        engine = start_engine(spec, load)
    except BaseException:
        if pool is not None:
            pool.close()
        raise
    engine_s = time.monotonic() - t0
    rt = runtime(asyncio.get_running_loop(), discovery=args.discovery,
                 request_plane=args.request_plane, nixl_host=args.nixl_host)
    path = f"{args.namespace}.{endpoint}"
    component = path.rsplit(".", 1)[0]
    # taken once, before anything is served (see plane/registration.py)
    served_endpoint = rt.endpoint(path)
    side = {name: rt.endpoint(f"{component}.{name}") for name in side_endpoints}
    publish_engine_load(served_endpoint, load)
    # the blocks the engine holds, for routers (started before requests can come)
    feed, subscriber, _ = block_feed.start_feed(
        rt, component, events, spec.extra.get("block_size", spec.block_size))
    loop = asyncio.get_running_loop()

    def publish_load() -> None:  # routers balance by it (kv_blocks streams)
        try:
            loop.call_soon_threadsafe(feed.load, load.num_running, load.num_waiting,
                                      load.kv_cache_usage)
        except RuntimeError:  # the loop has closed: the worker is stopping
            pass

    load.on_change = publish_load
    worker = make_worker(engine, WorkerContext(args, rt, feed.prefixes, component,
                                               served_endpoint.connection_id, pool))
    if inspect.isawaitable(worker):
        worker = await worker
    # the first client's request as fast as the rest: the engine's one-time costs, then the
    # worker's own path
    await engine.warm_up()
    await worker.warm_up()
    sides = [serve(rt, f"{component}.{name}", *worker.side_handler(name), endpoint=taken)
             for name, taken in side.items()]
    served = serve(rt, path, worker.handle, errors, endpoint=served_endpoint)
    rt.set_health_status(True)
    # the start's cost, to see a compile cache work (a GPU engine's first start compiles)
    log.info(f"[{path}] ready: engine started in {engine_s:.1f} s, warmed up in "
             f"{time.monotonic() - t0 - engine_s:.1f} s")
    watch = asyncio.ensure_future(watch_engine(rt, engine, path))
    code = await until_stopped(path, served_endpoint, {
        watch: lambda _: (ENGINE_DEAD, None),  # watch_engine said why
        **{task: lambda task: (1, f"an endpoint stopped serving: {task.exception()!r}")
           for task in (served, *sides)},
    })
    rt.set_health_status(False)
    feed.close()  # routers' streams end now: they are not requests to wait for
    rt.shutdown()  # stops accepting; graceful endpoints let in-flight requests finish
    if code == 0:
        try:
            await asyncio.wait_for(served, 30)
        except (asyncio.TimeoutError, Exception):
            pass
    for task in (watch, served, *sides):
        task.cancel()
    subscriber.close()
    engine.shutdown()
    close = getattr(worker, "close", None)  # what the worker started besides (media processes)
    if close is not None:
        close()
    return code
