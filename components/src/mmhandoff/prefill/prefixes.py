"""What a prefill worker publishes about each image prefix it computed, for the router's
placement: {image key: the engine's hashes of the prompt's full blocks through that image}.

The keys come from the frontend (frontend.placement.image_keys), one per image in prompt order;
the blocks through image i are the full blocks that end at or before its last placeholder token,
the ones any request with the same key shares (the text after the image may differ). Published
on the worker's kv_blocks stream (process.block_feed), kept by routers (router.prefix_table).
"""

from __future__ import annotations

from typing import Sequence

from mmhandoff.wire.handoff import Features


def image_ends(features: Features) -> list[int]:
    """Where each item's placeholders end, in prompt order."""
    return [span.offset + span.length for *_, span in features.items()]


def prefix_blocks(keys: Sequence[str], ends: Sequence[int], hashes: Sequence,
                  block_size: int) -> dict[str, list]:
    """{key: hashes of the full blocks through its image}, the images ending at `ends`; nothing
    when the keys do not match the images one to one (a frontend and a template that disagree:
    no placement hint), and no entry for an image that ends inside the first block."""
    if len(keys) != len(ends):
        return {}
    return {key: list(hashes[:end // block_size])
            for key, end in zip(keys, ends) if end >= block_size}
