"""What a prefill worker publishes about each image prefix it computed, for the router's
placement: {image key: the engine's hashes of the prompt's full blocks through that image}.

The keys come from the frontend (frontend.placement.image_keys), one per image in prompt order;
the blocks through image i are the full blocks that end at or before its last placeholder token,
the ones any request with the same key shares (the text after the image may differ). Published
on the worker's kv_blocks stream (serving.block_feed), kept by routers (router.prefix_table).
"""

from __future__ import annotations

from typing import Sequence

from mmhandoff.wire.handoff import Features


def image_spans(features: Features) -> list[tuple[int, int]]:
    """(offset, end) of every item's placeholders, in prompt order."""
    return sorted((s.offset, s.offset + s.length)
                  for spans in features.mm_placeholders.values() for s in spans)


def prefix_blocks(keys: Sequence[str], features: Features, hashes: Sequence,
                  block_size: int) -> dict[str, list]:
    """{key: hashes of the full blocks through its image}; nothing when the keys do not match
    the images one to one (a frontend and a template that disagree: no placement hint), and no
    entry for an image that ends inside the first block."""
    spans = image_spans(features)
    if len(keys) != len(spans):
        return {}
    out = {}
    for key, (_offset, end) in zip(keys, spans):
        n = end // block_size
        if n:
            out[key] = list(hashes[:n])
    return out
