"""Which KV blocks each engine instance holds, and, for a request's block hashes, how many of its
leading blocks each instance holds: the router's picture of the engines' prefix caches.

Fed from the workers' kv_blocks streams (router.follow: a snapshot, then the engine's KV events
as stored / removed / cleared), keyed by Dynamo instance; an instance that leaves discovery is
dropped. Block hashes are the engines' own (vllm_adapter.block_hashes), so a lookup
is set membership, chained: block i counts only if blocks 0..i-1 do (a prefix cache reuses a
prefix, not scattered blocks).
"""

from __future__ import annotations

from typing import Iterable, Sequence


class KvIndex:
    def __init__(self) -> None:
        self._holders: dict[int, set[int]] = {}  # block hash -> instances holding it
        self._held: dict[int, set[int]] = {}  # instance -> block hashes it holds

    def stored(self, instance: int, hashes: Iterable[int]) -> None:
        held = self._held.setdefault(instance, set())
        for h in hashes:
            held.add(h)
            self._holders.setdefault(h, set()).add(instance)

    def removed(self, instance: int, hashes: Iterable[int]) -> None:
        held = self._held.get(instance)
        if held is None:
            return
        for h in hashes:
            held.discard(h)
            holders = self._holders.get(h)
            if holders is not None:
                holders.discard(instance)
                if not holders:
                    del self._holders[h]

    def cleared(self, instance: int) -> None:
        """The instance holds nothing (its engine restarted, or reset its prefix cache)."""
        self.removed(instance, list(self._held.get(instance, ())))

    def drop(self, instance: int) -> None:
        """The instance is gone (left discovery): forget it."""
        self.cleared(instance)
        self._held.pop(instance, None)

    def apply(self, instance: int, kind: str, hashes: Iterable[int]) -> None:
        """One change as a worker's kv_blocks stream gives it (mmhandoff.wire.messages.KvBlocks):
        a snapshot replaces what the instance held."""
        if kind in ("snapshot", "cleared"):
            self.cleared(instance)
        if kind in ("snapshot", "stored"):
            self.stored(instance, hashes)
        elif kind == "removed":
            self.removed(instance, hashes)

    def instances(self) -> set[int]:
        return set(self._held)

    def blocks(self, instance: int) -> int:
        return len(self._held.get(instance, ()))

    def __len__(self) -> int:
        """Distinct blocks held anywhere."""
        return len(self._holders)

    def overlap(self, hashes: Sequence[int]) -> dict[int, int]:
        """{instance: how many of `hashes`' leading blocks it holds}, for every known instance
        (0 for one that holds not even the first)."""
        counts = dict.fromkeys(self._held, 0)
        alive = set(self._held)  # instances holding every block so far
        holders, none = self._holders, frozenset()
        for i, h in enumerate(hashes):
            held_by = holders.get(h, none)
            if alive <= held_by:  # nobody drops out: a set operation, no loop in Python
                continue
            for instance in alive - held_by:  # each instance is counted once, when it drops
                counts[instance] = i
            alive &= held_by
            if not alive:
                return counts
        for instance in alive:
            counts[instance] = len(hashes)
        return counts
