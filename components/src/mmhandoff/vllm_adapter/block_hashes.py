"""The prefix-cache block hashes an engine computes for a prompt, computed outside the engine:
what the router looks up to find the replica that holds a request's blocks, bit for bit the keys
of the engines' KV events.

It is vLLM's own hasher (`get_request_block_hasher`, the engine core's), run on a vLLM `Request`
that carries the prompt's token ids, each image's identity and placeholder range, and the
cache_salt, under the engine's settings: block size, hash algorithm, and the seed of the first
block's parent (NONE_HASH, from the engine's PYTHONHASHSEED: `EngineSpec.block_hash_seed`). A hash
is given as the KV events give it (as vLLM's `maybe_convert_block_hash`: by default the low 64
bits as an int).

vLLM keeps NONE_HASH in a module global, so one process hashes for one seed and algorithm: a
second BlockHasher with other settings is refused.
"""

from __future__ import annotations

import os
from typing import Iterable, Sequence

from mmhandoff.wire.handoff import Handoff

_LOW_64 = (1 << 64) - 1
_settings: tuple[str, int] | None = None  # (hash algorithm, seed) NONE_HASH was made with


class BlockHasher:
    def __init__(self, block_size: int, *, hash_algo: str = "sha256", seed: int = 0) -> None:
        from vllm.utils.hashing import get_hash_fn_by_name
        from vllm.v1.core import kv_cache_utils

        global _settings
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        fn = get_hash_fn_by_name(hash_algo)  # ValueError for an unknown algorithm
        if _settings is None:
            # An engine in this process already seeded vLLM's global: 0.31 records the seed it
            # used; 0.26 does not (the name is guarded: scripts/vllm_source.py), so there the
            # check is ours alone (_settings).
            engine_seed = getattr(kv_cache_utils, "_NONE_HASH_SEED", None)
            if engine_seed not in (None, str(seed)):
                raise ValueError(f"this process's vLLM hashes blocks with seed "
                                 f"{engine_seed!r}; asked for {seed}")
            saved = os.environ.get("PYTHONHASHSEED")
            os.environ["PYTHONHASHSEED"] = str(seed)  # how the engine core derives it
            try:
                kv_cache_utils.init_none_hash(fn)
            finally:
                if saved is None:
                    del os.environ["PYTHONHASHSEED"]
                else:
                    os.environ["PYTHONHASHSEED"] = saved
            _settings = (hash_algo, seed)
        elif _settings != (hash_algo, seed):
            raise ValueError(f"this process hashes blocks with {_settings} (vLLM keeps the seed "
                             f"in a global); asked for {(hash_algo, seed)}")
        from vllm import envs

        self.block_size = block_size
        self._hasher = kv_cache_utils.get_request_block_hasher(block_size, fn)
        # As vLLM's maybe_convert_block_hash, with its setting read once: vLLM reads the
        # environment on every call (0.43 of 1.0 ms for an 8k-token prompt, measured).
        self._as_int = bool(envs.VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES)

    def hashes(self, token_ids: Sequence[int],
               images: Iterable[tuple[str, int, int]] = (), *,
               cache_salt: str | None = None) -> list:
        """One hash per full block of `token_ids`; `images` are (identity, placeholder offset,
        placeholder length), in prompt order."""
        from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
        from vllm.sampling_params import SamplingParams
        from vllm.v1.request import Request

        features = [MultiModalFeatureSpec(
            data=None, modality="image", identifier=identity, mm_hash=identity,
            mm_position=PlaceholderRange(offset=offset, length=length))
            for identity, offset, length in images]
        request = Request("block-hashes", list(token_ids), SamplingParams(max_tokens=1), None,
                          mm_features=features or None, cache_salt=cache_salt)
        hashes = self._hasher(request)
        if self._as_int:
            return [int.from_bytes(h, "big") & _LOW_64 for h in hashes]
        return list(hashes)

    def of_handoff(self, h: Handoff) -> list:
        """The hashes decode's engine computes for a handoff's prompt."""
        return self.hashes(h.token_ids, [(digest, span.offset, span.length)
                                         for _modality, digest, span in h.items()],
                           cache_salt=h.cache_salt)
