"""Handoff vs full-media decode, measured side by side in one run (tiny model, CPU or GPU).

    .venv/bin/python benchmarks/handoff_vs_full_media.py [--requests 8] [--quick]

Arms (same prefill engine, same settings otherwise):
- handoff:    decode gets the Handoff (token ids, hashes, spans) and pulls KV over NIXL;
- full media: decode gets the prompt and the original image bytes, decodes and re-processes them,
              and pulls the same KV (what P/D stacks do today).
Per arm, image size (640x480 and 12 MP JPEG) and concurrency (1 and 4): decode-side input
preparation, TTFT (prefill start to first decode token) p50/p95, decode request bytes, ratios.
Then the NixlConnector overhead: per-request latency of one engine without a KV connector, with
NixlConnector (our settings: 0 UCX worker threads) and with vLLM's default 4 threads.
Peak RSS of every engine's processes is sampled throughout.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("UCX_NET_DEVICES", "lo")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

from benchmarks.common import PeakRSS, jpeg, pct, port  # noqa: E402


async def main(args) -> None:
    import msgspec
    from vllm import SamplingParams

    from components.decode_worker import DecodeWorker, FullMediaDecodeWorker
    from components.handoff import Sampling, encode_handoff
    from components.prefill_worker import PrefillWorker
    from components.protocol import FullMediaRequest, PrefillRequest
    from components.tiny_model import ensure_tiny_model
    from components.vllm_adapter import EngineSpec, start_engine

    model = str(ensure_tiny_model())
    mem = PeakRSS()
    engines = {}
    specs = {
        "prefill": EngineSpec(model=model, role="prefill", cpu_cores="0", nixl_port=port(), dtype="float32"),
        "decode": EngineSpec(model=model, role="decode", cpu_cores="1", nixl_port=port(), dtype="float32"),
        "full-media decode": EngineSpec(model=model, role="full_media_decode", cpu_cores="1",
                                        nixl_port=port(), dtype="float32"),
        "no connector": EngineSpec(model=model, role="agg", cpu_cores="1", dtype="float32"),
    }
    # vLLM's own NixlConnector settings (4 UCX threads, NIXL's spinning progress thread): started
    # only for its measurement at the end, since its idle spinning would slow everything else.
    default_spec = EngineSpec(model=model, role="full_media_decode", cpu_cores="1",
                              nixl_port=port(), dtype="float32", nixl_threads=4,
                              nixl_progress_delay_us=0)
    for name, spec in specs.items():
        print(f"[bench] starting {name} engine ...", file=sys.stderr, flush=True)
        before = mem.children()
        engines[name] = start_engine(spec)
        mem.add(name, mem.children() - before)

    prefill = PrefillWorker(engines["prefill"])
    decode = DecodeWorker(engines["decode"], kv_deadline_s=60)
    full = FullMediaDecodeWorker(engines["full-media decode"], kv_deadline_s=60)
    sampling = Sampling(max_tokens=8, temperature=0.0, ignore_eos=True)
    sizes = {"640x480": (640, 480), "12 MP": (4000, 3000)}

    async def one(arm: str, image: bytes, rid: str):
        t0 = time.perf_counter()
        uri = "data:image/jpeg;base64," + base64.b64encode(image).decode()
        messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": uri}},
                                                 {"type": "text", "text": "Describe it."}]}]
        req = PrefillRequest(request_id=rid, messages=messages, sampling=sampling)
        handoff, _ = await prefill.handoff(req)
        if arm == "handoff":
            wire = encode_handoff(handoff)
            stream = decode.generate(wire)
        else:
            prompt = prefill.tokenizer.apply_chat_template(
                [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Describe it."}]}],
                tokenize=False, add_generation_prompt=True)
            wire = msgspec.msgpack.encode(FullMediaRequest(
                request_id=rid, prompt=prompt, images=[image],
                kv_transfer_params=handoff.kv_transfer_params, sampling=sampling))
            stream = full.generate(wire)
        ttft = None
        last = None
        async for chunk in stream:
            if ttft is None:
                ttft = (time.perf_counter() - t0) * 1e3
            last = chunk
        return ttft, last.stats.prepare_ms, len(wire)

    rows = []
    seed = 0
    for size_name, (w, h) in sizes.items():
        n = args.requests
        images = [jpeg(w, h, 1000 + i) for i in range(2 * n + 2)]
        for conc in (1, 4):
            for arm in ("full media", "handoff"):
                await one(arm, images[-1], f"warm-{arm}-{size_name}-{conc}")  # warm-up
                results = []
                for start in range(0, n, conc):
                    batch = [one(arm, images[(seed + i) % (2 * n)], f"{arm}-{size_name}-{conc}-{start + i}")
                             for i in range(min(conc, n - start))]
                    results += await asyncio.gather(*batch)
                    seed += len(batch)
                ttfts = [r[0] for r in results]
                rows.append((size_name, conc, arm, statistics.median(r[1] for r in results),
                             pct(ttfts, 50), pct(ttfts, 95), statistics.median(r[2] for r in results)))

    print("\n## Handoff vs full media (tiny model, TTFT = prefill start to first decode token)\n")
    print("| image | conc | arm | decode prep ms | TTFT p50 ms | TTFT p95 ms | decode request bytes |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r[0]} | {r[1]} | {r[2]} | {r[3]:.2f} | {r[4]:.1f} | {r[5]:.1f} | {r[6]:,.0f} |")
    print("\n| image | conc | handoff/full TTFT p50 | TTFT p50 reduction | handoff/full request bytes |")
    print("|---|---|---|---|---|")
    for i in range(0, len(rows), 2):
        f, hnd = rows[i], rows[i + 1]
        print(f"| {f[0]} | {f[1]} | {hnd[4] / f[4]:.2f} | {100 * (1 - hnd[4] / f[4]):.0f}% | "
              f"{hnd[6] / f[6]:.5f} ({100 * hnd[6] / f[6]:.3f}%) |")

    print("\n## NixlConnector overhead (text prompt, 8 output tokens, sequential, core 1)\n")

    async def latency(name: str) -> float:
        times = []
        for i in range(args.requests * 2 + 1):
            t0 = time.perf_counter()
            async for _ in engines[name].generate(
                    {"prompt": f"Count to ten, number {i}."},
                    SamplingParams(max_tokens=8, temperature=0, ignore_eos=True), f"lat-{name}-{i}"):
                pass
            times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times[1:])

    def idle_cpu(name: str, seconds: float = 3.0) -> float:
        """CPU used by an idle engine's processes, in cores."""
        import psutil

        procs = [psutil.Process(p) for p in mem.groups[name]]
        t0 = sum(sum(p.cpu_times()[:2]) for p in procs)
        time.sleep(seconds)
        return (sum(sum(p.cpu_times()[:2]) for p in procs) - t0) / seconds

    rows2 = []
    # ours: measured with the idle prefill and decode engines still up (the real set-up: three
    # NIXL engines on two cores)
    base = await latency("no connector")
    rows2.append(("no connector", base, 1.0, idle_cpu("no connector")))
    ours = await latency("full-media decode")
    rows2.append(("NixlConnector, mmhandoff settings (2 more NIXL engines idle)", ours, ours / base,
                  idle_cpu("full-media decode")))
    if not args.quick:
        for name in ("prefill", "decode"):  # make room: vLLM's defaults are measured alone
            engines.pop(name).shutdown()
        before = mem.children()
        name = "NixlConnector, vLLM defaults"
        engines[name] = start_engine(default_spec)
        mem.add(name, mem.children() - before)
        spin = idle_cpu(name)
        base2 = await latency("no connector")
        dflt = await latency(name)
        rows2.append((name + " (alone)", dflt, dflt / base2, spin))
    print("| engine | latency p50 ms | ratio to no connector | idle CPU (cores) |")
    print("|---|---|---|---|")
    for label, v, ratio, cpu in rows2:
        print(f"| {label} | {v:.1f} | {ratio:.2f} | {cpu:.2f} |")

    print("\n## Peak resident memory per engine (engine core + worker processes)\n")
    print("| engine | peak RSS GiB |")
    print("|---|---|")
    for name, v in mem.peak.items():
        print(f"| {name} | {v / 2**30:.2f} |")
    mem.stop()
    for eng in engines.values():
        eng.shutdown()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=8, help="requests per arm and setting")
    parser.add_argument("--quick", action="store_true",
                        help="skip the engine with vLLM's default NIXL settings")
    asyncio.run(main(parser.parse_args()))
