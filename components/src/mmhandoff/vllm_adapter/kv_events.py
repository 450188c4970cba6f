"""A subscriber for an engine's KV events (vLLM's ZMQ publisher): collects the blocks it stores,
or hands each batch of events to a callback.

The events are vLLM's own wire format, hence this module's place in the adapter. The engine binds
(`tcp://*:PORT` or `ipc://...` in its kv_events_config); this side connects. A worker turns them
into its `kv_blocks` stream for routers (`changes`, mmhandoff.process.block_feed); tests use the
collected blocks to compare block hashes between engines.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Callable, Iterator

import msgspec
import zmq


@dataclass(frozen=True)
class StoredBlock:
    block_hash: int
    parent: int | None
    token_ids: tuple[int, ...]
    extra_keys: tuple | None


class KVEventSubscriber:
    """With `on_events`, each batch's events go to it (from the subscriber's thread) and nothing
    is kept; without, every event is kept for `events()` and `stored()` (tests)."""

    def __init__(self, endpoint: str, topic: str = "kv-events", *,
                 on_events: Callable[[list], None] | None = None) -> None:
        from vllm.distributed.kv_events import KVEventBatch  # wire type owned by vLLM

        self._decoder = msgspec.msgpack.Decoder(KVEventBatch)
        self._ctx = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.SUB)
        self._sock.setsockopt(zmq.SUBSCRIBE, topic.encode())
        self._sock.setsockopt(zmq.RCVTIMEO, 100)
        self._sock.connect(endpoint)
        self._on_events = on_events
        self._lock = threading.Lock()
        self._stored: list[StoredBlock] = []
        self._events: list = []  # every event, in order (vLLM's types)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"kv-events {endpoint}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                _topic, _seq, payload = self._sock.recv_multipart()
            except zmq.Again:
                continue
            batch = self._decoder.decode(payload)
            if self._on_events is not None:
                self._on_events(batch.events)
                continue
            with self._lock:
                self._events.extend(batch.events)
                for event in batch.events:
                    if type(event).__name__ != "BlockStored":
                        continue
                    size = event.block_size
                    for i, block_hash in enumerate(event.block_hashes):
                        extra = event.extra_keys[i] if event.extra_keys else None
                        self._stored.append(StoredBlock(
                            block_hash=block_hash,
                            parent=event.parent_block_hash if i == 0 else event.block_hashes[i - 1],
                            token_ids=tuple(event.token_ids[i * size:(i + 1) * size]),
                            extra_keys=tuple(map(tuple, extra)) if extra else None))

    def stored(self) -> list[StoredBlock]:
        with self._lock:
            return list(self._stored)

    def events(self) -> list:
        with self._lock:
            return list(self._events)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        self._sock.close(linger=0)


def changes(events) -> Iterator[tuple[str, list]]:
    """vLLM's KV events as (kind, block hashes) in order: "stored", "removed", or "cleared"
    (every block gone; no hashes). Other events (none today) are skipped."""
    for event in events:
        kind = type(event).__name__
        if kind == "BlockStored":
            yield "stored", list(event.block_hashes)
        elif kind == "BlockRemoved":
            yield "removed", list(event.block_hashes)
        elif kind == "AllBlocksCleared":
            yield "cleared", []


def feed(index, instance: int, events) -> None:
    """vLLM's KV events, applied in order to a router index (mmhandoff.router.index.KvIndex) as
    the blocks `instance` holds."""
    for kind, hashes in changes(events):
        index.apply(instance, kind, hashes)
