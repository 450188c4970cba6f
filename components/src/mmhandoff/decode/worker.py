"""Decode worker: admits a Handoff, pulls its KV through NIXL, streams tokens. Never sees media.
With prefill's first token in the handoff (v2) it streams the answer from the second token on.
For an M-RoPE model (Qwen2-VL) the handoff carries each image's grid (v5), from which the engine
computes positions.

Admission (mmhandoff.wire.handoff) refuses bad messages before the engine sees them. The engine's
fail-closed scheduler refuses to compute any image position; when it does, or when the KV load
fails, or when the first token misses the KV deadline, the request ends with `KVCoverageError`
naming the cause and the engine stays healthy. The caller may retry the whole request through
prefill.
"""

from __future__ import annotations

import time
from contextlib import aclosing
import uuid
from typing import AsyncIterator, Awaitable, Callable, Sequence

import msgspec

from mmhandoff.engine import Engine, EngineInputError
from mmhandoff.engine.stream import KVCoverageError, collect, stream_answer
from mmhandoff.plane.endpoints import generate
from mmhandoff.wire.handoff import (
    VERSION,
    ClaimFailed,
    Handoff,
    HandoffError,
    ReplayGuard,
    Sampling,
    check_admission,
    decode_handoff,
    encode_handoff,
    sign,
)
from mmhandoff.wire.messages import DecodeChunk, handoff_bytes

__all__ = ["DecodeWorker", "KVCoverageError", "UnsupportedModel", "collect"]


class UnsupportedModel(RuntimeError):
    pass


class DecodeWorker:
    def __init__(self, engine: Engine, *, kv_deadline_s: float | None = 30.0,
                 keys: Sequence[bytes] = (),
                 claim: Callable[[Handoff], Awaitable[None]] | None = None) -> None:
        """`keys`: take only handoffs signed with one of them (several during a rotation).
        `claim`: claims a handoff that names where (`Handoff.claim`) before its KV is pulled
        (decode.claims.ClaimClient); without it such a handoff is refused."""
        if engine.capabilities.mrope and engine.capabilities.grid_rules is None:
            raise UnsupportedModel("this M-RoPE model's positions need more of the media than "
                                   "each item's grid, which is all a handoff carries "
                                   "(Qwen2-VL, Qwen2.5-VL and Qwen3-VL are served)")
        if engine.capabilities.encoder_decoder:
            raise UnsupportedModel("encoder-decoder models need the encoder output on decode")
        self.engine = engine
        self.kv_deadline_s = kv_deadline_s
        self.keys = tuple(keys)
        self.replays = ReplayGuard()
        self.claim = claim

    def admit(self, message: Handoff | bytes) -> tuple[Handoff, int]:
        """Decode and check a handoff (its bytes, as they arrived; in-process callers may give
        a Handoff); raise a HandoffError if it is refused. Also its size in bytes."""
        wire = encode_handoff(message) if isinstance(message, Handoff) else bytes(message)
        handoff = decode_handoff(wire)  # a Handoff object gets the same checks as bytes
        check_admission(handoff, fingerprint=self.engine.fingerprint, keys=self.keys,
                        grid_rules=self.engine.capabilities.grid_rules)
        self.replays.admit(handoff)  # last: a refused message does not use up its nonce
        return handoff, len(wire)

    async def generate(self, message: Handoff | bytes) -> AsyncIterator[DecodeChunk]:
        t0 = time.perf_counter()
        handoff, size = self.admit(message)
        if handoff.claim is not None:  # its KV is read once in the whole graph
            if self.claim is None:
                raise ClaimFailed("this decode cannot claim a handoff's KV at its prefill")
            await self.claim(handoff)
        admitted_at = time.time()
        engine_request_id = f"{handoff.request_id}:decode:{uuid.uuid4().hex[:8]}"
        request = await self.engine.kv_only(handoff, engine_request_id)
        prepare_ms = (time.perf_counter() - t0) * 1e3
        async with aclosing(stream_answer(
                self.engine, request, handoff.request_id, engine_request_id,
                kv_deadline_s=self.kv_deadline_s, request_bytes=size, prepare_ms=prepare_ms,
                t0=t0, admitted_at=admitted_at,
                sent_in_prompt=handoff.first_token is not None)) as chunks:
            async for chunk in chunks:
                yield chunk

    async def warm_up(self) -> None:
        """One short answer through the whole decode path (admission, the metadata-only input,
        the first token's continuation, the engine's first steps) before the worker reports
        ready: a fresh decode's first request took 14.4 ms to prepare, the next ones 0.4-0.8."""
        rendered = await self.engine.render("Warm up.", [])
        handoff = Handoff(
            v=VERSION, request_id=f"warm-up-{uuid.uuid4().hex[:8]}",
            model_fingerprint=self.engine.fingerprint, token_ids=rendered.token_ids,
            features=rendered.features, requires_kv=False, kv_transfer_params={},
            sampling=Sampling(max_tokens=3, temperature=0.0, ignore_eos=True),
            first_token=rendered.token_ids[-1])
        if self.keys:
            handoff = sign(handoff, self.keys[0], ttl_s=60.0)
        async with aclosing(self.generate(encode_handoff(handoff))) as chunks:
            async for _ in chunks:
                pass

    async def handle(self, request: dict) -> AsyncIterator[dict]:
        """Dynamo endpoint handler: a HandoffMessage in its builtin form in (the bytes prefill
        signed), DecodeChunk dicts out."""
        async with aclosing(self.generate(handoff_bytes(request))) as chunks:
            async for chunk in chunks:
                yield msgspec.to_builtins(chunk)


ENDPOINT = generate("decode")
ERRORS = (HandoffError, KVCoverageError, EngineInputError)


def main(argv: list[str] | None = None) -> int:
    from mmhandoff.decode.claims import ClaimClient
    from mmhandoff.decode.full_media import FullMediaDecodeWorker, InvalidFullMedia
    from mmhandoff.process.engine_worker import run

    def make_worker(engine, context):
        args = context.args
        if args.full_media:
            return FullMediaDecodeWorker(engine, kv_deadline_s=args.kv_deadline_s)
        return DecodeWorker(engine, kv_deadline_s=args.kv_deadline_s, keys=args.handoff_keys,
                            claim=ClaimClient(context.rt))

    return run("decode", lambda a: "full_media_decode" if a.full_media else "decode",
               ENDPOINT, make_worker, (*ERRORS, InvalidFullMedia), argv)


if __name__ == "__main__":
    raise SystemExit(main())
