"""A worker's `kv_blocks` endpoint: the blocks its engine holds, for routers.

A stream per caller: first a snapshot of every block the engine holds, the engine's load (requests
running and waiting) and (prefill) the blocks of the image prefixes it computed lately, then each
change in the engine's order, from its KV events (vLLM's ZMQ publisher on an abstract-namespace IPC
socket: no port, no file). A router that starts late or restarts calls again and gets the whole
picture from the holder of the truth, so nothing has to be replayed from a log, with or without
NATS; a worker that stops ends its streams, and routers forget its blocks. A caller that falls
behind by `MAX_BEHIND` changes has its stream ended (it calls again for a fresh snapshot) instead of
growing this worker's memory.
"""

from __future__ import annotations

import asyncio
import os
import uuid
from collections import OrderedDict
from typing import AsyncIterator

import msgspec

from mmhandoff.plane.endpoints import KV_BLOCKS
from mmhandoff.wire.messages import KvBlocks

MAX_BEHIND = 10_000
MAX_PREFIXES = 1024  # image prefixes kept for snapshots (the router keeps more: prefix_table)


def events_endpoint() -> str:
    """Where this worker's engine publishes its KV events (bound by the engine core)."""
    return f"ipc://@mmhandoff-kv-events-{os.getpid()}-{uuid.uuid4().hex[:8]}"


class BlockFeed:
    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._held: set = set()
        self._queues: set[asyncio.Queue] = set()
        self._closed = False
        self._load = (0, 0, 0.0)  # requests running, waiting; KV cache usage
        # image key -> its prefix's block hashes (prefill workers), latest last
        self._prefixes: OrderedDict[str, list] = OrderedDict()

    def apply(self, changes) -> None:
        """(kind, hashes) changes in order (vllm_adapter.kv_events.changes); on the loop."""
        for kind, hashes in changes:
            if kind == "cleared":
                self._held.clear()
            elif kind == "stored":
                self._held.update(hashes)
            else:
                self._held.difference_update(hashes)
            self._send(msgspec.to_builtins(KvBlocks(kind=kind, hashes=hashes)))

    def load(self, running: int, waiting: int, kv_usage: float = 0.0) -> None:
        """The engine's requests as of its last step and the share of its KV cache they hold;
        sent when the requests change (the usage goes with them). On the loop."""
        if (running, waiting) != self._load[:2]:
            self._load = (running, waiting, kv_usage)
            self._send(msgspec.to_builtins(KvBlocks(kind="load", running=running,
                                                    waiting=waiting, kv_usage=kv_usage)))

    def prefixes(self, prefixes: dict[str, list]) -> None:
        """What image keys stand for in this engine's blocks (prefill.prefixes); kept for the
        snapshots of routers that come later (the `MAX_PREFIXES` latest). On the loop."""
        for key, hashes in prefixes.items():
            self._prefixes[key] = hashes
            self._prefixes.move_to_end(key)
        while len(self._prefixes) > MAX_PREFIXES:
            self._prefixes.popitem(last=False)
        self._send(msgspec.to_builtins(KvBlocks(kind="prefixes", prefixes=prefixes)))

    def _send(self, item: dict) -> None:
        for q in list(self._queues):
            if q.qsize() >= MAX_BEHIND:
                self._queues.discard(q)
                q.put_nowait(None)  # the caller catches up with a new snapshot
            else:
                q.put_nowait(item)

    def held(self) -> int:
        return len(self._held)

    async def handle(self, _request) -> AsyncIterator[dict]:
        q: asyncio.Queue = asyncio.Queue()
        if self._closed:
            return
        self._queues.add(q)
        try:
            # one message: a router that has it has the whole picture (router.follow)
            running, waiting, kv_usage = self._load
            yield msgspec.to_builtins(KvBlocks(
                kind="snapshot", hashes=list(self._held), block_size=self.block_size,
                running=running, waiting=waiting, kv_usage=kv_usage,
                prefixes=dict(self._prefixes)))
            while (item := await q.get()) is not None:
                yield item
        finally:
            self._queues.discard(q)

    def close(self) -> None:
        """End every stream (the worker is stopping: in-flight streams must not hold it up)."""
        self._closed = True
        for q in self._queues:
            q.put_nowait(None)
        self._queues.clear()


def start_feed(rt, component_path: str, endpoint: str, block_size: int):
    """Serve `<component_path>.kv_blocks` from the engine's events at `endpoint`; returns
    (feed, subscriber, serving future). Close the feed, then the subscriber, on stop."""
    from mmhandoff.plane.runtime import serve
    from mmhandoff.vllm_adapter.kv_events import KVEventSubscriber, changes

    loop = asyncio.get_running_loop()
    feed = BlockFeed(block_size)

    def on_events(events) -> None:  # the subscriber's thread
        batch = list(changes(events))
        try:
            loop.call_soon_threadsafe(feed.apply, batch)
        except RuntimeError:  # the loop has closed: the worker is gone
            pass

    subscriber = KVEventSubscriber(endpoint, on_events=on_events)
    served = serve(rt, f"{component_path}.{KV_BLOCKS}", feed.handle, ())
    return feed, subscriber, served
