"""A subscriber for an engine's KV events (vLLM's ZMQ publisher), collecting the blocks it stores.

The events are vLLM's own wire format, hence this module's place in the adapter. The engine binds
(`tcp://*:PORT` in its kv_events_config); this side connects. The router will build its index
from the same stream (`feed`); tests use it to compare block hashes between engines.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import msgspec
import zmq


@dataclass(frozen=True)
class StoredBlock:
    block_hash: int
    parent: int | None
    token_ids: tuple[int, ...]
    extra_keys: tuple | None


class KVEventSubscriber:
    def __init__(self, endpoint: str, topic: str = "kv-events") -> None:
        from vllm.distributed.kv_events import KVEventBatch  # wire type owned by vLLM

        self._decoder = msgspec.msgpack.Decoder(KVEventBatch)
        self._ctx = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.SUB)
        self._sock.setsockopt(zmq.SUBSCRIBE, topic.encode())
        self._sock.setsockopt(zmq.RCVTIMEO, 100)
        self._sock.connect(endpoint)
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


def feed(index, instance: int, events) -> None:
    """vLLM's KV events, applied in order to a router index (mmhandoff.router.index.KvIndex) as
    the blocks `instance` holds."""
    for event in events:
        kind = type(event).__name__
        if kind == "BlockStored":
            index.stored(instance, event.block_hashes)
        elif kind == "BlockRemoved":
            index.removed(instance, event.block_hashes)
        elif kind == "AllBlocksCleared":
            index.cleared(instance)
