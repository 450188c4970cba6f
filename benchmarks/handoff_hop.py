"""One hop of the handoff through the real Dynamo runtime, in its two wire forms, side by side in
one run (issue 34): what a router or decode pays per request for the message itself.

    .venv/bin/python benchmarks/handoff_hop.py [--tokens 2048,8192,16384] [--requests 300]

- fields: the Handoff's own fields as a map (the form before 2026-12-06, which older frontends
  still send): Dynamo turns its list of token ids into Python ints on the way in and back into
  JSON on the way out; the handler converts the map to the typed Handoff.
- bytes: `HandoffMessage`, the handoff's bytes as prefill signed them (base64 text in Dynamo's
  JSON): one string crosses; the handler decodes the bytes into the typed Handoff.
Both handlers then check the signature (as the router and decode do) and answer one small item.
The caller and the endpoint run in one process on one runtime (TCP request plane on loopback,
file discovery), so each figure is a request's round trip: the caller's serialisation, the
hop, the handler's, and back. Median and p99 in microseconds, and bytes / fields.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import tempfile
import time

KEY = b"k" * 32


def handoff(n_tokens: int, rng: random.Random):
    from mmhandoff.wire.handoff import (
        VERSION,
        BlockHashes,
        Features,
        Handoff,
        Sampling,
        Span,
        sign,
    )

    h = Handoff(v=VERSION, request_id="hop", model_fingerprint="f" * 64,
                token_ids=[rng.randrange(32_000) for _ in range(n_tokens)],
                features=Features(mm_hashes={"image": ["a" * 64]},
                                  mm_placeholders={"image": [Span(offset=5, length=576)]}),
                requires_kv=True, kv_transfer_params={"do_remote_prefill": True,
                                                      "remote_block_ids": list(range(64))},
                sampling=Sampling(max_tokens=32, temperature=0.0),
                block_hashes=BlockHashes(block_size=32, hashes=[
                    rng.getrandbits(64) for _ in range(n_tokens // 32)]))
    return sign(h, KEY, ttl_s=3600)


async def main(args) -> None:
    import msgspec

    from mmhandoff.plane.runtime import call_one, client, runtime, serve
    from mmhandoff.wire.handoff import Handoff, authentic, decode_handoff, encode_handoff
    from mmhandoff.wire.messages import HandoffMessage, handoff_bytes

    async def as_fields(message):  # the older path: Dynamo's map converted to the type
        yield {"ok": authentic(msgspec.convert(message, Handoff), [KEY])}

    async def as_bytes(message):
        yield {"ok": authentic(decode_handoff(handoff_bytes(message)), [KEY])}

    rt = runtime(asyncio.get_running_loop(), discovery="file", request_plane="tcp")
    try:
        serve(rt, "hop.fields.generate", as_fields, ())
        serve(rt, "hop.bytes.generate", as_bytes, ())
        clients = {"fields": await client(rt, "hop.fields.generate"),
                   "bytes": await client(rt, "hop.bytes.generate")}
        rng = random.Random(3)
        print(f"{'tokens':>6} | {'fields p50':>10} {'p99':>6} | {'bytes p50':>9} {'p99':>6} | "
              f"bytes / fields (p50) | message: fields JSON / bytes base64 (KB)")
        for n in args.tokens:
            h = handoff(n, rng)
            messages = {"fields": msgspec.to_builtins(h),
                        "bytes": msgspec.to_builtins(HandoffMessage(encode_handoff(h)))}
            times: dict[str, list[float]] = {arm: [] for arm in messages}
            for i in range(args.requests):  # interleaved, so both arms see the same host
                for arm in (("fields", "bytes") if i % 2 else ("bytes", "fields")):
                    t0 = time.perf_counter()
                    answer = await call_one(clients[arm], messages[arm], stall_s=30)
                    times[arm].append((time.perf_counter() - t0) * 1e6)
                    assert answer == {"ok": True}, (arm, answer)
            p = {arm: (statistics.median(t), sorted(t)[int(0.99 * (len(t) - 1))])
                 for arm, t in times.items()}
            size = {arm: len(msgspec.json.encode(m)) / 1024 for arm, m in messages.items()}
            print(f"{n:>6} | {p['fields'][0]:>10.0f} {p['fields'][1]:>6.0f} | "
                  f"{p['bytes'][0]:>9.0f} {p['bytes'][1]:>6.0f} | "
                  f"{p['bytes'][0] / p['fields'][0]:>19.2f}x | "
                  f"{size['fields']:.1f} / {size['bytes']:.1f}")
    finally:
        rt.shutdown()


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=lambda s: [int(x) for x in s.split(",")],
                    default=[2048, 8192, 16384])
    ap.add_argument("--requests", type=int, default=300)
    args = ap.parse_args()
    for var in ("DYN_TCP_RPC_HOST", "DYN_TCP_RESPONSE_STREAM_HOST", "DYN_EVENT_PLANE_HOST"):
        os.environ.setdefault(var, "127.0.0.1")  # loopback only
    with tempfile.TemporaryDirectory(prefix="mmhandoff-hop-") as discovery:
        os.environ.setdefault("DYN_FILE_KV", discovery)  # removed at the end
        asyncio.run(main(args))
