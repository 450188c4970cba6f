"""Keeps a tier's KvIndex up to date from the workers' `kv_blocks` streams
(mmhandoff.process.block_feed), and each worker's engine load (requests running and waiting)
and, from prefill workers, the blocks each image key stands for (router.prefix_table), from the
same streams.

One stream per live instance of the endpoint, keyed by its Dynamo instance id (the same id its
`generate` endpoint has). A stream that ends or breaks (the worker stopped, fell behind, or the
network failed) drops the instance's blocks; if the instance is still in discovery it is followed
again and its snapshot rebuilds them. An instance that leaves discovery is dropped. A worker
whose engine uses another block size than the router hashes with is not indexed (its hashes could
never match): said once on stderr.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Callable

import msgspec

from mmhandoff.plane.runtime import RemoteError, call
from mmhandoff.router.tier import Tier
from mmhandoff.wire.messages import KvBlocks

log = logging.getLogger(__name__)

DISCOVERY_POLL_S = 0.5  # how often the instance list is compared with the streams followed


class Follower:
    def __init__(self, feeds, tier: Tier, block_size: int,
                 on_prefixes: Callable[[dict[str, list]], None] | None = None) -> None:
        self.feeds = feeds  # Dynamo client of <component>.kv_blocks
        self.on_prefixes = on_prefixes  # what a prefill worker says its image keys stand for
        # kept here, per instance: the blocks it holds, its engine's requests running + waiting,
        # the share of its KV cache held
        self.tier = tier
        self.index, self.loads, self.kv_usage = tier.index, tier.loads, tier.kv_usage
        self.block_size = block_size
        self._streams: dict[int, asyncio.Task] = {}
        self._refused: set[int] = set()
        self._synced: set[int] = set()  # instances whose snapshot arrived on the current stream
        self.snapshots = 0  # streams (re)started and synced: for tests and metrics

    async def ready(self, timeout_s: float) -> bool:
        """Wait (at most `timeout_s`) until every live instance's snapshot is in the index: a
        router that answers before then routes by load alone (correct, but no hits)."""
        async def synced() -> None:
            while not set(self.feeds.instance_ids()) <= self._synced | self._refused:
                await asyncio.sleep(0.01)
        try:
            await asyncio.wait_for(synced(), timeout_s)
            return True
        except TimeoutError:
            return False

    def unsynced(self) -> int:
        """Live instances whose blocks the index does not have yet (a stream being started or
        restarted after a break): the index is stale for them."""
        return len(set(self.feeds.instance_ids()) - self._synced - self._refused)

    async def run(self) -> None:
        try:
            while True:
                self.sync(set(self.feeds.instance_ids()))
                await asyncio.sleep(DISCOVERY_POLL_S)
        finally:
            for task in self._streams.values():
                task.cancel()

    def sync(self, live: set[int]) -> None:
        for instance, task in list(self._streams.items()):
            if instance not in live or task.done():
                task.cancel()
                del self._streams[instance]
                self.index.drop(instance)
        for instance in live - self._streams.keys() - self._refused:
            self._streams[instance] = asyncio.ensure_future(self._follow(instance))

    async def _follow(self, instance: int) -> None:
        try:
            async for item in call(self.feeds, {}, instance, lost="kv_blocks_lost"):
                update = msgspec.convert(item, KvBlocks)
                if update.kind in ("load", "snapshot"):
                    self.loads[instance] = update.running + update.waiting
                    self.kv_usage[instance] = update.kv_usage
                if update.prefixes and self.on_prefixes is not None:  # prefixes, or a snapshot
                    self.on_prefixes(update.prefixes)
                if update.kind in ("load", "prefixes"):
                    continue
                if update.kind == "snapshot":
                    if update.block_size != self.block_size:
                        self._refused.add(instance)
                        log.info(f"[router] instance {instance:x} hashes blocks of "
                                 f"{update.block_size} tokens, this router {self.block_size}: not "
                                 f"routing by its KV (set the same block size on both)")
                        return
                    self.snapshots += 1
                    self._synced.add(instance)
                self.index.apply(instance, update.kind, update.hashes)
        except (RemoteError, msgspec.ValidationError):
            pass  # sync() drops it and follows it again while it is alive
        finally:
            self._synced.discard(instance)
            self.loads.pop(instance, None)
            self.kv_usage.pop(instance, None)
            self.index.drop(instance)
