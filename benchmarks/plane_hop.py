"""One Dynamo hop with several requests in flight: Nagle on the request plane's server side
(ai-dynamo-runtime 1.6 as it comes) against off (plane/nodelay.py), side by side in one run.

    .venv/bin/python benchmarks/plane_hop.py [--rounds 30] [--bytes 1000]

Each arm runs in its own process (the setting is process-wide), twice, in the order A B B A, on
the real runtime (TCP request plane on loopback, file discovery): the caller and the endpoint in
one process, the endpoint answering one small item at once. A request's time is its round trip
to its answer (`call_one`), p50 / max in ms over `rounds` rounds of `concurrency` at once.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

CONCURRENCY = (1, 2, 4, 8, 16)


async def measure(rounds: int, size: int) -> dict[int, list[float]]:
    from mmhandoff.plane.runtime import call_one, client, runtime, serve

    async def answer(request):
        yield {"n": len(request["body"])}

    rt = runtime(asyncio.get_running_loop(), discovery="file", request_plane="tcp")
    try:
        serve(rt, "hop.nagle.generate", answer, ())
        c = await client(rt, "hop.nagle.generate")
        body = {"body": "x" * size}
        await call_one(c, body, stall_s=30)  # connected, and the first-request set-up done
        out: dict[int, list[float]] = {}
        for n in CONCURRENCY:
            times = out.setdefault(n, [])

            async def one() -> None:
                t0 = time.perf_counter()
                await call_one(c, body, stall_s=30)
                times.append((time.perf_counter() - t0) * 1e3)

            for _ in range(rounds):
                await asyncio.gather(*[one() for _ in range(n)])
        return out
    finally:
        rt.shutdown()


def child(rounds: int, size: int) -> None:
    for var in ("DYN_TCP_RPC_HOST", "DYN_TCP_RESPONSE_STREAM_HOST", "DYN_EVENT_PLANE_HOST"):
        os.environ.setdefault(var, "127.0.0.1")  # loopback only
    with tempfile.TemporaryDirectory(prefix="mmhandoff-nagle-") as discovery:
        os.environ["DYN_FILE_KV"] = discovery
        result = asyncio.run(measure(rounds, size))
    print("RESULT " + json.dumps(result), flush=True)


def run_arm(nodelay: bool, rounds: int, size: int) -> dict[int, list[float]]:
    env = {**os.environ, "MMHANDOFF_REQUEST_PLANE_NODELAY": "1" if nodelay else "0"}
    done = subprocess.run([sys.executable, __file__, "--child", "--rounds", str(rounds),
                           "--bytes", str(size)], env=env, capture_output=True, text=True,
                          timeout=600)
    lines = [l for l in done.stdout.splitlines() if l.startswith("RESULT ")]
    if done.returncode or not lines:
        raise SystemExit(f"arm nodelay={nodelay} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return {int(k): v for k, v in json.loads(lines[-1][7:]).items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--bytes", type=int, default=1000, help="the request's payload")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args.rounds, args.bytes)
    times: dict[bool, dict[int, list[float]]] = {False: {}, True: {}}
    for nodelay in (False, True, True, False):
        for n, t in run_arm(nodelay, args.rounds, args.bytes).items():
            times[nodelay].setdefault(n, []).extend(t)
    print(f"{'in flight':>9} | {'Nagle on p50':>12} {'max':>7} | {'off p50':>8} {'max':>7} | "
          f"off / on (p50)")
    for n in CONCURRENCY:
        on, off = times[False][n], times[True][n]
        print(f"{n:>9} | {statistics.median(on):>12.2f} {max(on):>7.2f} | "
              f"{statistics.median(off):>8.2f} {max(off):>7.2f} | "
              f"{statistics.median(off) / statistics.median(on):.2f}x")


if __name__ == "__main__":
    main()
