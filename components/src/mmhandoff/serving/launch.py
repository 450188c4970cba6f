"""Running one component as its own process: `python -m mmhandoff.<component> --model DIR ...`.

Starts the component's engine, serves its handler on the Dynamo runtime, reports ready on Dynamo's
system status server (mmhandoff.serving.health), and on SIGINT/SIGTERM reports not ready, stops
serving (in-flight requests finish), then shuts the engine down. If the engine dies, it exits with
`health.ENGINE_DEAD` (3).
"""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import os
import signal
import sys
from typing import Callable


def parser(role: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=f"python -m mmhandoff.{role}")
    p.add_argument("--model", help="model folder (default: the tiny test model, built if missing)")
    p.add_argument("--namespace", default="mmhandoff")
    p.add_argument("--cpu-cores", help='CPU machines: cores for the engine, e.g. "0" or "0-1"')
    p.add_argument("--nixl-port", type=int, help="NIXL side-channel port of this engine")
    p.add_argument("--nixl-host", type=_ip, default=os.environ.get("POD_IP") or "127.0.0.1",
                   help="address of this engine's NIXL side channel (the KV handshake) that the "
                        "other engines reach; default $POD_IP (Kubernetes), else 127.0.0.1")
    p.add_argument("--kv-lease-s", type=int, help="prefill: how long unpulled KV is held")
    p.add_argument("--kv-deadline-s", type=float, default=30.0, help="decode: KV pull deadline")
    p.add_argument("--discovery", help='Dynamo discovery backend ("file", "etcd", ...)')
    p.add_argument("--request-plane", help='Dynamo request plane ("tcp" or "nats")')
    p.add_argument("--full-media", action="store_true",
                   help="benchmark arm: prefill hands decode the media; decode re-processes it")
    return p


def _ip(value: str) -> str:
    """An IP address (the side channel binds to it: a host name would not do)."""
    try:
        return str(ipaddress.ip_address(value))
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an IP address: {value!r}") from None


def engine_spec(args: argparse.Namespace, role: str):
    """The EngineSpec a component's command line asks for."""
    from mmhandoff.models.tiny import ensure_tiny_model
    from mmhandoff.vllm_adapter import EngineSpec

    return EngineSpec(model=args.model or str(ensure_tiny_model()), role=role,
                      cpu_cores=args.cpu_cores, nixl_port=args.nixl_port,
                      nixl_host=args.nixl_host, kv_lease_s=args.kv_lease_s)


def run(role: str, spec_role: str | Callable, endpoint: str, make_handler: Callable,
        errors: tuple, argv: list[str] | None = None) -> int:
    """`spec_role`: the EngineSpec role, or a function of the parsed arguments giving it."""
    args = parser(role).parse_args(argv)
    from mmhandoff.serving.runtime import run as run_loop
    from mmhandoff.vllm_adapter import fast_exit

    code = run_loop(_serve(args, spec_role, endpoint, make_handler, errors))
    if fast_exit.enabled():
        # The engine and the runtime are down. The interpreter's finalization would scan the
        # whole vLLM and torch heap to free nothing (~3 s on 2 cores): end the process now.
        fast_exit.end_process(code)
    return code


async def _serve(args, spec_role, endpoint, make_handler, errors) -> int:
    from mmhandoff.serving.health import ENGINE_DEAD, start_not_ready, watch_engine
    from mmhandoff.serving.runtime import runtime, serve
    from mmhandoff.vllm_adapter import start_engine

    spec = engine_spec(args, spec_role(args) if callable(spec_role) else spec_role)
    start_not_ready()
    engine = start_engine(spec)
    rt = runtime(asyncio.get_running_loop(), discovery=args.discovery,
                 request_plane=args.request_plane)
    path = f"{args.namespace}.{endpoint}"
    served = serve(rt, path, make_handler(engine, args), errors)
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    rt.set_health_status(True)
    print(f"[{path}] ready", file=sys.stderr, flush=True)
    stopped = asyncio.ensure_future(stop.wait())
    watch = asyncio.ensure_future(watch_engine(rt, engine, path))
    await asyncio.wait([stopped, watch, served], return_when=asyncio.FIRST_COMPLETED)
    code = 0
    if watch.done():
        code = ENGINE_DEAD
    elif served.done():
        print(f"[{path}] the endpoint stopped serving: {served.exception()!r}", file=sys.stderr,
              flush=True)
        code = 1
    rt.set_health_status(False)
    rt.shutdown()  # stops accepting; graceful endpoints let in-flight requests finish
    if code == 0:
        try:
            await asyncio.wait_for(served, 30)
        except (asyncio.TimeoutError, Exception):
            pass
    for task in (stopped, watch, served):
        task.cancel()
    engine.shutdown()
    return code
