"""Decode router: takes a handoff and streams it to the decode replica that already holds most of
its blocks.

The request's block hashes are computed with vLLM's own hasher under the engines' settings
(vllm_adapter.block_hashes) and looked up in an index of what each decode instance holds, fed by
the workers' kv_blocks streams (router.follow). Scorers rate each live instance (KV overlap,
load; router.scorers), their weighted sum decides, and ties go to the least loaded, then in turn.
With an empty index (just started, nothing cached yet) the overlap is 0 everywhere and load
decides. Policy "round_robin" skips all of it (Dynamo's round robin: the baseline).
"""

from __future__ import annotations

import asyncio
import math
import signal
import sys
import time
from collections import Counter
from typing import Any, AsyncIterator, Mapping

import msgspec

from mmhandoff.router.index import KvIndex
from mmhandoff.router.scorers import Candidates
from mmhandoff.router.scorers.load import LoadScorer
from mmhandoff.router.scorers.overlap import OverlapScorer
from mmhandoff.serving.runtime import RemoteError, call, error_envelope
from mmhandoff.wire.handoff import Handoff, HandoffError, decode_handoff
from mmhandoff.wire.messages import KvHeld

SCORERS = {s.name: s for s in (OverlapScorer(), LoadScorer())}
DEFAULT_WEIGHTS = {"overlap": 1.0, "load": 0.1}
POLICIES = ("kv", "round_robin")
SYNC_WAIT_S = 10.0  # at start, how long the router waits for the workers' snapshots


class Router:
    def __init__(self, decode, *, policy: str = "kv", hasher=None, index: KvIndex | None = None,
                 weights: Mapping[str, float] = DEFAULT_WEIGHTS) -> None:
        if policy not in POLICIES:
            raise ValueError(f"unknown policy {policy!r}; expected one of {POLICIES}")
        unknown = set(weights) - set(SCORERS)
        if unknown:
            raise ValueError(f"unknown scorers {sorted(unknown)}; known: {sorted(SCORERS)}")
        self.decode = decode  # Dynamo client of decode.generate
        self.policy = policy
        self.hasher = hasher  # BlockHasher with the engines' settings (policy "kv")
        self.index = index if index is not None else KvIndex()
        self.weights = {name: w for name, w in weights.items() if w}
        self.in_flight: Counter[int] = Counter()
        self._turn = 0
        self.decisions: Counter[str] = Counter()  # by reason (router.metrics)
        self.blocks_total = self.overlap_total = 0  # the prompts' blocks; the chosen held
        self.decision_s_total = 0.0
        self.lookups = 0  # router.held calls (prefill's bypass)

    def pick(self, handoff: dict) -> tuple[int | None, str]:
        """(decode instance, reason) for this handoff; instance None = Dynamo's round robin."""
        live = sorted(self.decode.instance_ids())
        if self.policy == "round_robin" or len(live) < 2:
            return None, "round_robin"
        parsed = self._hashed(handoff)
        if parsed is None:  # decode refuses it with the typed error; any replica will do
            return None, "unparsed"
        h, hashes = parsed
        c = Candidates(live, self.index.overlap(hashes), len(hashes), dict(self.in_flight))
        # prefill's bypass: a handoff that names no KV to pull can only be answered where its
        # blocks are, so the overlap alone decides (prefill.bypass)
        weights = {"overlap": 1.0} if not h.kv_transfer_params else self.weights
        total = dict.fromkeys(live, 0.0)
        for name, weight in weights.items():
            for instance, score in SCORERS[name].score(c).items():
                total[instance] += weight * score
        best = max(total.values())
        tied = [i for i in live if math.isclose(total[i], best)]
        fewest = min(self.in_flight[i] for i in tied)
        tied = [i for i in tied if self.in_flight[i] == fewest]
        choice = tied[self._turn % len(tied)]
        self._turn += 1
        self.blocks_total += len(hashes)
        self.overlap_total += c.overlap.get(choice, 0)
        if not h.kv_transfer_params:
            return choice, "bypass"
        return choice, ("overlap" if c.overlap.get(choice, 0) else "load")

    def held(self, handoff: dict) -> KvHeld:
        """The live decode instance holding most of the handoff's leading blocks (for prefill's
        bypass: prefill.bypass), by the same index and hashes as `pick`."""
        live = sorted(self.decode.instance_ids())
        parsed = self._hashed(handoff) if self.policy == "kv" and live else None
        if parsed is None:
            return KvHeld()
        hashes = parsed[1]
        overlap = self.index.overlap(hashes)
        best = max(live, key=lambda i: (overlap.get(i, 0), -self.in_flight[i]))
        held = overlap.get(best, 0)
        return KvHeld(instance=best if held else None, blocks_held=held, blocks=len(hashes))

    def _hashed(self, handoff: dict) -> tuple[Handoff, list] | None:
        """The handoff and its blocks' hashes (the engines'), or None if decode would refuse it."""
        try:
            h = decode_handoff(msgspec.msgpack.encode(handoff))
        except HandoffError:
            return None
        return h, self.hasher.of_handoff(h)

    async def handle_held(self, handoff: dict) -> AsyncIterator[dict[str, Any]]:
        self.lookups += 1
        yield msgspec.to_builtins(self.held(handoff))

    async def handle(self, handoff: dict) -> AsyncIterator[dict[str, Any]]:
        t0 = time.perf_counter()
        instance, reason = self.pick(handoff)
        self.decision_s_total += time.perf_counter() - t0
        self.decisions[reason] += 1
        if instance is not None:
            self.in_flight[instance] += 1
        try:
            async for chunk in call(self.decode, handoff, instance, lost="decode_failed"):
                yield chunk
        except RemoteError as e:  # decode's typed error goes back to the caller as it came
            yield error_envelope(e)
        finally:
            if instance is not None:
                self.in_flight[instance] -= 1
                if not self.in_flight[instance]:
                    del self.in_flight[instance]


def _weights(text: str) -> dict[str, float]:
    """"overlap=1,load=0.1" -> {"overlap": 1.0, "load": 0.1}"""
    import argparse

    try:
        pairs = (item.split("=", 1) for item in text.split(",") if item)
        return {name.strip(): float(value) for name, value in pairs}
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected NAME=WEIGHT,..., got {text!r}") from None


ENDPOINT = "router.generate"
HELD = "held"  # the second endpoint, <component>.held: which replica holds a prompt's blocks


def parser():
    """The router's command line (the deploy manifests' args are checked against it)."""
    import argparse

    p = argparse.ArgumentParser(prog="python -m mmhandoff.router")
    p.add_argument("--namespace", default="mmhandoff")
    p.add_argument("--decode", default="decode.generate",
                   help="the decode endpoint it routes to (serve wires it from the graph)")
    p.add_argument("--wait-s", type=float, default=600, help="how long to wait for decode")
    p.add_argument("--policy", choices=POLICIES, default="kv",
                   help="kv: the replica holding most of the request's blocks (default); "
                        "round_robin: Dynamo's, the baseline")
    p.add_argument("--weights", type=_weights, default=DEFAULT_WEIGHTS,
                   help=f"scorer weights, e.g. overlap=1,load=0.1 (scorers: {sorted(SCORERS)})")
    p.add_argument("--block-size", type=int, default=32,
                   help="the decode engines' KV block size (EngineSpec's default: 32)")
    p.add_argument("--block-hash-seed", type=int, default=0,
                   help="the engines' block-hash seed (EngineSpec.block_hash_seed)")
    return p


def main(argv: list[str] | None = None) -> int:
    from mmhandoff.serving.health import start_not_ready
    from mmhandoff.serving.runtime import client, runtime, serve
    from mmhandoff.serving.runtime import run as run_loop

    args = parser().parse_args(argv)

    async def run() -> int:
        from mmhandoff.router.follow import Follower
        from mmhandoff.router.metrics import publish_router_metrics
        from mmhandoff.serving.block_feed import ENDPOINT as KV_BLOCKS
        from mmhandoff.vllm_adapter.block_hashes import BlockHasher

        start_not_ready()
        rt = runtime(asyncio.get_running_loop())
        decode = await client(rt, f"{args.namespace}.{args.decode}", args.wait_s)
        router = Router(decode, policy=args.policy, weights=args.weights,
                        hasher=BlockHasher(args.block_size, seed=args.block_hash_seed))
        component = args.decode.rsplit(".", 1)[0]
        feeds = await rt.endpoint(f"{args.namespace}.{component}.{KV_BLOCKS}").client()
        follow = follower = None
        if args.policy == "kv":
            follower = Follower(feeds, router.index, args.block_size)
            follow = asyncio.ensure_future(follower.run())
            if not await follower.ready(SYNC_WAIT_S):
                print(f"[router] not every decode instance's blocks arrived in {SYNC_WAIT_S:g} "
                      f"s; routing by load until they do", file=sys.stderr, flush=True)
        publish_router_metrics(rt.endpoint(f"{args.namespace}.{ENDPOINT}"), router, follower)
        served = serve(rt, f"{args.namespace}.{ENDPOINT}", router.handle, ())
        held_path = f"{args.namespace}.{ENDPOINT.rsplit('.', 1)[0]}.{HELD}"
        serving_held = serve(rt, held_path, router.handle_held, ())
        rt.set_health_status(True)
        print(f"[{args.namespace}.{ENDPOINT}] ready", file=sys.stderr, flush=True)
        stop = asyncio.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            asyncio.get_running_loop().add_signal_handler(sig, stop.set)
        await stop.wait()
        rt.set_health_status(False)
        if follow is not None:
            follow.cancel()
        rt.shutdown()
        await asyncio.wait([served, serving_held], timeout=30)
        return 0

    return run_loop(run())


if __name__ == "__main__":
    raise SystemExit(main())
