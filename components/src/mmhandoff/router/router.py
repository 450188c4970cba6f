"""KV router: places each request on the prefill replica and its handoff on the decode replica
that already hold most of its blocks.

Decode: the handoff's block hashes, the ones prefill's engine computed and signed with the
handoff (or, for a handoff without them or not authentic, computed here with vLLM's own hasher
under the engines' settings: vllm_adapter.block_hashes), are looked up in an index of what each
decode instance holds, fed by the workers' kv_blocks streams (router.follow). Scorers rate each
live instance (KV overlap, load: the router's own streams or the worker's published requests,
whichever is more; router.scorers), their weighted sum decides, and ties go to the least loaded,
then in turn.
With an empty index (just started, nothing cached yet) the overlap is 0 everywhere and load
decides.

Prefill (router.place, asked by the frontend before prefill): the request's image keys
(frontend.placement) name its image prefixes; the prefill workers publish which engine blocks
each key stands for (router.prefix_table), and the prefill instances' index (their kv_blocks
streams) says who holds them. Load there is what the prefill workers publish.

Policy "round_robin" skips all of it (Dynamo's round robin: the baseline); "random" picks
uniformly, seeded (the benchmarks' other baseline).
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import random
import time
from collections import Counter
from typing import Any, AsyncIterator, Mapping, Sequence

import msgspec

from mmhandoff import logs
from mmhandoff.plane.endpoints import GENERATE, HELD, KV_BLOCKS, PLACE, beside, generate
from mmhandoff.plane.handoff_keys import KEY_ENV, KEY_FILE_ENV, handoff_keys
from mmhandoff.plane.runtime import RemoteError, call, error_envelope
from mmhandoff.router.prefix_table import PrefixTable
from mmhandoff.router.scorers import SCORERS, Candidates
from mmhandoff.router.tier import Tier
from mmhandoff.wire.handoff import HandoffError, authentic, decode_handoff, routing_view
from mmhandoff.wire.messages import KvHeld, Placement, PlaceRequest, handoff_bytes

log = logging.getLogger(__name__)

DEFAULT_WEIGHTS = {"overlap": 1.0, "load": 0.1}
POLICIES = ("kv", "round_robin", "random")
SYNC_WAIT_S = 10.0  # at start, how long the router waits for the workers' snapshots


class Router:
    def __init__(self, decode, *, prefill=None, policy: str = "kv", hasher=None,
                 weights: Mapping[str, float] = DEFAULT_WEIGHTS,
                 keys: Sequence[bytes] = ()) -> None:
        """`decode`, `prefill`: Dynamo clients of the tiers' generate endpoints (no prefill: no
        placement). `keys`: the handoff keys (decode's); a handoff's own block hashes are used
        only when it is authentic (with no keys: unsigned, or its checksum verifies)."""
        if policy not in POLICIES:
            raise ValueError(f"unknown policy {policy!r}; expected one of {POLICIES}")
        unknown = set(weights) - set(SCORERS)
        if unknown:
            raise ValueError(f"unknown scorers {sorted(unknown)}; known: {sorted(SCORERS)}")
        self.decode = Tier("decode", decode)
        self.prefill = Tier("prefill", prefill)
        self.policy = policy
        self.hasher = hasher  # BlockHasher with the engines' settings (policy "kv")
        self.keys = tuple(keys)
        self.table = PrefixTable()  # image keys -> engine blocks, as prefill workers publish
        self.weights = {name: w for name, w in weights.items() if w}
        self.in_flight: Counter[int] = Counter()  # decode requests this router streams
        self._turns: Counter[str] = Counter()  # per tier: who is next among equals
        self._random = random.Random(0)  # policy "random": the benchmarks' baseline, seeded
        self.decisions: Counter[str] = Counter()  # by reason (router.metrics)
        self.placements: Counter[str] = Counter()  # prefill placements by reason
        self.blocks_total = self.overlap_total = 0  # the prompts' blocks; the chosen held
        self.decision_s_total = 0.0
        self.lookups = 0  # router.held calls (prefill's bypass)
        self.hashed_by: Counter[str] = Counter()  # "prefill" (carried) or "router"

    def pick(self, message: dict) -> tuple[int | None, str]:
        """(decode instance, reason) for this message (a HandoffMessage in builtin form);
        instance None = Dynamo's round robin."""
        live = self.decode.live()
        if self.policy == "round_robin" or len(live) < 2:
            return None, "round_robin"
        if self.policy == "random":
            return self._random.choice(live), "random"
        parsed = self._hashed(message)
        if parsed is None:  # decode refuses it with the typed error; any replica will do
            return None, "unparsed"
        h, hashes = parsed
        # prefill's bypass: a handoff that names no KV to pull can only be answered where its
        # blocks are, so the overlap alone decides (prefill.bypass)
        weights = {"overlap": 1.0} if not h.kv_transfer_params else self.weights
        # this router's own streams are exact at once; what the worker published also counts
        # other routers' requests
        choice, held = self._choose(self.decode, live, hashes, weights, self.in_flight)
        self.blocks_total += len(hashes)
        self.overlap_total += held
        if not h.kv_transfer_params:
            return choice, "bypass"
        return choice, ("overlap" if held else "load")

    def place(self, request: PlaceRequest) -> Placement:
        """The prefill instance for a request, before prefill: the one holding the blocks of its
        longest image prefix the table knows (by the prefill engines' own KV events), load
        (the workers' published requests) breaking ties. None (round robin) without image
        keys, with one prefill instance, or under policy round_robin."""
        live = self.prefill.live()
        if self.policy == "round_robin" or len(live) < 2 or not request.image_keys:
            return Placement()
        if self.policy == "random":
            return Placement(instance=self._random.choice(live), reason="random")
        hashes = self.table.deepest(request.image_keys)
        choice, held = self._choose(self.prefill, live, hashes, self.weights)
        return Placement(instance=choice, reason="overlap" if held else "load",
                         blocks_held=held, blocks=len(hashes))

    def _choose(self, tier: Tier, live: list[int], hashes: Sequence, weights: Mapping[str, float],
                own: Mapping[int, int] = {}) -> tuple[int, int]:
        """(instance, its leading blocks held) with the best weighted score for a request whose
        blocks are `hashes`, among `live` of `tier`; ties to the least loaded, then in turn.
        An instance's load is the more of what it published and `own` (requests this router
        streams to it)."""
        overlap = tier.index.overlap(hashes) if hashes else {}
        load = {i: max(own.get(i, 0), tier.loads.get(i, 0)) for i in live}
        c = Candidates(live, overlap, len(hashes), load, tier.kv_usage)
        total = dict.fromkeys(c.instances, 0.0)
        for name, weight in weights.items():
            for instance, score in SCORERS[name].score(c).items():
                total[instance] += weight * score
        best = max(total.values())
        tied = [i for i in c.instances if math.isclose(total[i], best)]
        fewest = min(c.in_flight.get(i, 0) for i in tied)
        tied = [i for i in tied if c.in_flight.get(i, 0) == fewest]
        choice = tied[self._turns[tier.name] % len(tied)]
        self._turns[tier.name] += 1
        return choice, overlap.get(choice, 0)

    def held(self, message: dict) -> KvHeld:
        """The live decode instance holding most of the handoff's leading blocks (for prefill's
        bypass: prefill.bypass), by the same index and hashes as `pick`."""
        live = self.decode.live()
        parsed = self._hashed(message) if self.policy == "kv" and live else None
        if parsed is None:
            return KvHeld()
        hashes = parsed[1]
        overlap = self.decode.index.overlap(hashes)
        best = max(live, key=lambda i: (overlap.get(i, 0), -self.in_flight[i]))
        held = overlap.get(best, 0)
        return KvHeld(instance=best if held else None, blocks_held=held, blocks=len(hashes))

    def _hashed(self, message: dict) -> tuple[Any, list] | None:
        """The handoff (read from its bytes, which go on to decode as they came) and its blocks'
        hashes (the engines'), or None if decode would refuse it. An authentic handoff with
        prefill's hashes is read without its token ids (wire.handoff.routing_view)."""
        try:
            wire = handoff_bytes(message)
        except HandoffError:
            return None
        view = routing_view(wire)
        if (view is not None and view.block_hashes.block_size == self.hasher.block_size
                and authentic(view, self.keys)):
            self.hashed_by["prefill"] += 1
            return view, view.block_hashes.hashes
        try:
            h = decode_handoff(wire)
        except HandoffError:
            return None
        self.hashed_by["router"] += 1
        return h, self.hasher.of_handoff(h)

    async def handle_held(self, message: dict) -> AsyncIterator[dict[str, Any]]:
        self.lookups += 1
        yield msgspec.to_builtins(self.held(message))

    async def handle_place(self, request: dict) -> AsyncIterator[dict[str, Any]]:
        t0 = time.perf_counter()
        try:
            placement = self.place(msgspec.convert(request, PlaceRequest))
        except msgspec.ValidationError:
            placement = Placement()  # the frontend's own message: round robin, never an error
        self.decision_s_total += time.perf_counter() - t0
        self.placements[placement.reason] += 1
        yield msgspec.to_builtins(placement)

    async def handle(self, message: dict) -> AsyncIterator[dict[str, Any]]:
        t0 = time.perf_counter()
        instance, reason = self.pick(message)
        self.decision_s_total += time.perf_counter() - t0
        self.decisions[reason] += 1
        if instance is not None:
            self.in_flight[instance] += 1
        try:
            async for chunk in call(self.decode.client, message, instance, lost="decode_failed"):
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


ENDPOINT = generate("router")


def parser():
    """The router's command line (the deploy manifests' args are checked against it)."""
    import argparse

    p = argparse.ArgumentParser(prog="python -m mmhandoff.router")
    p.add_argument("--namespace", default="mmhandoff")
    p.add_argument("--decode", default="decode.generate",
                   help="the decode endpoint it routes to (serve wires it from the graph)")
    p.add_argument("--prefill", default="prefill.generate",
                   help="the prefill endpoint whose replicas it places requests on (router.place; "
                        "its workers' kv_blocks streams tell what each holds)")
    p.add_argument("--wait-s", type=float, default=600, help="how long to wait for decode")
    p.add_argument("--policy", choices=POLICIES, default="kv",
                   help="kv: the replica holding most of the request's blocks (default); "
                        "round_robin: Dynamo's, the baseline; random: a seeded uniform choice "
                        "(benchmarks)")
    p.add_argument("--weights", type=_weights, default=DEFAULT_WEIGHTS,
                   help=f"scorer weights, e.g. overlap=1,load=0.1 (scorers: {sorted(SCORERS)})")
    p.add_argument("--block-size", type=int, default=32,
                   help="the decode engines' KV block size (EngineSpec's default: 32)")
    p.add_argument("--block-hash-seed", type=int, default=0,
                   help="the engines' block-hash seed (EngineSpec.block_hash_seed)")
    p.add_argument("--handoff-key-file", default=os.environ.get(KEY_FILE_ENV),
                   help="decode's handoff keys (default $%s, or the keys in $%s): a handoff's "
                        "block hashes, computed by prefill, are used only when its signature "
                        "verifies; otherwise the router hashes the prompt itself"
                        % (KEY_FILE_ENV, KEY_ENV))
    return p


async def _followers(rt, args, router: Router) -> dict:
    """{tier: Follower} of the decode and prefill workers' kv_blocks streams, each keeping its
    tier's index and loads in `router`, and the prefill workers' image prefixes in its table."""
    from mmhandoff.router.follow import Follower

    followers = {}
    for tier, endpoint in ((router.decode, args.decode), (router.prefill, args.prefill)):
        feeds = await rt.endpoint(f"{args.namespace}.{beside(endpoint, KV_BLOCKS)}").client()
        followers[tier.name] = Follower(feeds, tier, args.block_size,
                                        on_prefixes=router.table.update)
    return followers

def main(argv: list[str] | None = None) -> int:
    from mmhandoff.plane.runtime import client, runtime, serve
    from mmhandoff.plane.runtime import run as run_loop
    from mmhandoff.process.health import start_not_ready

    args = parser().parse_args(argv)
    logs.setup()

    async def run() -> int:
        from mmhandoff.process.lifecycle import until_stopped
        from mmhandoff.router.metrics import publish_router_metrics
        from mmhandoff.vllm_adapter.block_hashes import BlockHasher

        start_not_ready()
        rt = runtime(asyncio.get_running_loop())
        decode = await client(rt, f"{args.namespace}.{args.decode}", args.wait_s)
        # prefill starts after the router (it asks the router): its instances come and go
        prefill = await rt.endpoint(f"{args.namespace}.{args.prefill}").client()
        router = Router(decode, prefill=prefill, policy=args.policy, weights=args.weights,
                        hasher=BlockHasher(args.block_size, seed=args.block_hash_seed),
                        keys=handoff_keys(args))
        # every endpoint is taken before any is served (plane/registration.py)
        endpoints = {name: rt.endpoint(f"{args.namespace}.{beside(ENDPOINT, name)}")
                     for name in (GENERATE, HELD, PLACE)}
        followers = await _followers(rt, args, router) if args.policy == "kv" else {}
        follows = [asyncio.ensure_future(f.run()) for f in followers.values()]
        synced = await asyncio.gather(*(f.ready(SYNC_WAIT_S) for f in followers.values()))
        for tier, ok in zip(followers, synced):
            if not ok:
                log.warning(f"[router] not every {tier} instance's blocks arrived in "
                            f"{SYNC_WAIT_S:g} s; routing by load until they do")
        publish_router_metrics(endpoints[GENERATE], router, followers)
        served = [serve(rt, f"{args.namespace}.{beside(ENDPOINT, name)}", handler, (),
                        endpoint=endpoints[name])
                  for name, handler in ((GENERATE, router.handle), (HELD, router.handle_held),
                                        (PLACE, router.handle_place))]
        rt.set_health_status(True)
        log.info(f"[{args.namespace}.{ENDPOINT}] ready")
        # out of discovery (an etcd lease lost), no frontend would call it again: exit, as a
        # worker does, so that serve or Kubernetes restarts it (plane/registration.py)
        code = await until_stopped(f"{args.namespace}.{ENDPOINT}", endpoints[GENERATE])
        rt.set_health_status(False)
        for task in follows:
            task.cancel()
        rt.shutdown()
        if code == 0:
            await asyncio.wait(served, timeout=30)
        return code

    return run_loop(run())


if __name__ == "__main__":
    raise SystemExit(main())
