"""Dynamo clients served in this process: the frontend's calls reach a worker's endpoint handler
directly, with the same error envelopes and stop signal as through the runtime, and every message
copied through its JSON form, as the wire would."""

from __future__ import annotations

from contextlib import aclosing

import msgspec

from mmhandoff.plane.runtime import endpoint_handler


class Item:
    """What a Dynamo stream yields: an annotated item whose data is the builtin value."""

    def __init__(self, data) -> None:
        self._data = data

    def data(self):
        return self._data


def _wire(value):
    return msgspec.json.decode(msgspec.json.encode(value))


class LocalClient:
    def __init__(self, handler, errors: tuple) -> None:
        self.endpoint = endpoint_handler(handler, errors)
        self.requests = 0

    def instance_ids(self):
        return [1]

    async def round_robin(self, request, context=None):
        self.requests += 1
        items = self.endpoint(_wire(request), context)

        async def stream():
            async with aclosing(items):
                async for item in items:
                    yield Item(_wire(item))
        return stream()

    async def direct(self, request, instance_id, context=None):
        return await self.round_robin(request, context)
