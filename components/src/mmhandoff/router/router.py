"""Decode router: takes a handoff and streams it to one decode replica.

Today it passes through (Dynamo's round robin over the live decode instances); the KV-aware
choice (the replica that already holds most of the request's blocks, by the engine's own block
hashes) lands with the router issue and replaces `pick`. It is its own component so that the
frontend and the graph do not change when it does.
"""

from __future__ import annotations

import asyncio
import signal
import sys
from typing import Any, AsyncIterator

from mmhandoff.serving.runtime import RemoteError, call, error_envelope


class Router:
    def __init__(self, decode) -> None:
        self.decode = decode  # Dynamo client of decode.generate

    def pick(self, handoff: dict) -> int | None:
        """The decode instance for this handoff; None = let Dynamo round-robin."""
        return None

    async def handle(self, handoff: dict) -> AsyncIterator[dict[str, Any]]:
        try:
            async for chunk in call(self.decode, handoff, self.pick(handoff),
                                    lost="decode_failed"):
                yield chunk
        except RemoteError as e:  # decode's typed error goes back to the caller as it came
            yield error_envelope(e)


ENDPOINT = "router.generate"


def main(argv: list[str] | None = None) -> int:
    import argparse

    from mmhandoff.serving.health import start_not_ready
    from mmhandoff.serving.runtime import client, runtime, serve
    from mmhandoff.serving.runtime import run as run_loop

    p = argparse.ArgumentParser(prog="python -m mmhandoff.router")
    p.add_argument("--namespace", default="mmhandoff")
    p.add_argument("--decode", default="decode.generate",
                   help="the decode endpoint it routes to (serve wires it from the graph)")
    p.add_argument("--wait-s", type=float, default=600, help="how long to wait for decode")
    args = p.parse_args(argv)

    async def run() -> int:
        start_not_ready()
        rt = runtime(asyncio.get_running_loop())
        decode = await client(rt, f"{args.namespace}.{args.decode}", args.wait_s)
        served = serve(rt, f"{args.namespace}.{ENDPOINT}", Router(decode).handle, ())
        rt.set_health_status(True)
        print(f"[{args.namespace}.{ENDPOINT}] ready", file=sys.stderr, flush=True)
        stop = asyncio.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            asyncio.get_running_loop().add_signal_handler(sig, stop.set)
        await stop.wait()
        rt.set_health_status(False)
        rt.shutdown()
        await asyncio.wait([served], timeout=30)
        return 0

    return run_loop(run())


if __name__ == "__main__":
    raise SystemExit(main())
