"""What the frontend's image keys stand for in engine blocks, as the prefill workers publish it.

The frontend cannot compute the engine's block hashes before prefill (they need the rendered
token ids and each image's pixel hash), but it can name each image's prefix cheaply
(frontend.placement.image_keys). A prefill worker that computed a request with keys publishes,
on its kv_blocks stream, the hashes of the prompt's full blocks through each image
(prefill.prefixes); every router following it keeps them here. Hashes do not depend on the
replica (the engines' own function and settings), so one table serves the whole prefill tier;
who holds the blocks now is the prefill index's business (router.place).

Bounded: least recently used keys are forgotten first (a forgotten key costs one placement by
load, until a prefill publishes it again).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Mapping, Sequence

MAX_KEYS = 4096


class PrefixTable:
    def __init__(self, max_keys: int = MAX_KEYS) -> None:
        self.max_keys = max_keys
        self._blocks: OrderedDict[str, tuple] = OrderedDict()

    def update(self, prefixes: Mapping[str, Sequence]) -> None:
        """{image key: its prefix's block hashes}, as a prefill worker published them."""
        for key, hashes in prefixes.items():
            self._blocks[key] = tuple(hashes)
            self._blocks.move_to_end(key)
        while len(self._blocks) > self.max_keys:
            self._blocks.popitem(last=False)

    def deepest(self, keys: Sequence[str]) -> tuple:
        """The blocks of the longest prefix among `keys` (in prompt order) that is known; empty
        when none is."""
        for key in reversed(keys):
            blocks = self._blocks.get(key)
            if blocks is not None:
                self._blocks.move_to_end(key)
                return blocks
        return ()

    def __len__(self) -> int:
        return len(self._blocks)
