"""Handoff vs full-media decode, measured side by side in one run (tiny model, CPU or GPU).

    .venv/bin/python benchmarks/handoff_vs_full_media.py [--requests 8] [--quick]
    # the M-RoPE path: the tiny Qwen2-VL (each image's grid travels in the handoff)
    .venv/bin/python benchmarks/handoff_vs_full_media.py --model-shape tiny-qwen2-vl
    # on a GPU (docs/gpu.md): a LLaVA-1.5-7B-shaped model with random weights
    python benchmarks/handoff_vs_full_media.py --model-shape llava-1.5-7b --concurrency 1,8 \
        --skip-overhead
    # videos (Qwen-VL shapes only): 4 s at 640x360 and 8 s at 1280x720, 30 frames a second
    python benchmarks/handoff_vs_full_media.py --model-shape qwen2.5-vl-7b --media video \
        --concurrency 1,4 --skip-overhead

Arms (same prefill engine, same settings otherwise):
- full media: decode gets the prompt and the original image bytes, decodes and re-processes them,
              pulls the same KV and samples the first token (what P/D stacks do today);
- handoff:    decode gets the Handoff (token ids, hashes, spans), pulls KV over NIXL and samples
              the first token (the older contract);
- handoff, prefill's token: the same handoff, but the answer's first token is prefill's (the
              client has it when prefill answers) and decode goes on from the second (the
              product's contract).
Per arm, image size (640x480 and 12 MP JPEG; with `--media video`, two clips) and concurrency
(default 1 and 4): decode-side input
preparation, decode submit-to-first-token (admission, input preparation, KV pull, one step),
TTFT (prefill start to the answer's first token: decode's, or prefill's in the third arm)
p50/p95, decode request bytes, the prompt tokens decode pulled over NIXL, ratios.
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
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("UCX_NET_DEVICES", "lo")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

from benchmarks.common import PeakRSS, jpeg, mp4, pct, port  # noqa: E402

PREFILLS_TOKEN = "handoff, prefill's token"
ARMS = ("full media", "handoff", PREFILLS_TOKEN)


async def main(args) -> None:
    mem, engines = PeakRSS(), {}
    try:
        await measure(args, mem, engines)
    finally:  # a failed run too: no engine left running, no IPC files left behind
        mem.stop()
        for eng in engines.values():
            eng.shutdown()
        engines.clear()  # no AsyncLLM.__del__ at interpreter exit


async def measure(args, mem, engines: dict) -> None:
    import msgspec

    from mmhandoff.decode.full_media import FullMediaDecodeWorker
    from mmhandoff.decode.worker import DecodeWorker
    from mmhandoff.models.dummy import ensure_dummy_model
    from mmhandoff.models.tiny import ensure_tiny_model
    from mmhandoff.prefill.worker import PrefillWorker
    from mmhandoff.vllm_adapter import EngineSpec, start_engine
    from mmhandoff.vllm_adapter.engine import on_cpu
    from mmhandoff.vllm_adapter.inputs import sampling_params
    from mmhandoff.wire.handoff import Sampling, encode_handoff
    from mmhandoff.wire.messages import (
        ChatMessage,
        FullMediaRequest,
        PrefillRequest,
        TextPart,
        VideoPart,
        VideoURL,
        user,
    )

    if args.model_shape in ("tiny", "tiny-qwen2-vl", "tiny-qwen2.5-vl"):
        arch = {"tiny": "llava", "tiny-qwen2-vl": "qwen2_vl"}.get(args.model_shape, "qwen2_5_vl")
        model = str(ensure_tiny_model(arch=arch))
        common = dict(model=model, dtype="float32")
        cores = {"prefill": "0", "decode": "1", "full-media decode": "1", "no connector": "1"}
    else:  # a real-size shape with random weights; GPU: each engine gets a share of it
        model = str(ensure_dummy_model(args.model_shape))
        common = dict(model=model, dtype="bfloat16", extra={"load_format": "dummy"},
                      gpu_memory_utilization=None if on_cpu() else args.gpu_memory_utilization,
                      enforce_eager=args.enforce_eager or None,
                      max_model_len=args.max_model_len)
        cores = {}
    common.update(block_size=args.block_size, cuda_ipc_get=args.cuda_ipc_get != "off",
                  kv_blocks_across_layers=args.kv_blocks_across_layers == "on")
    if args.cuda_ipc_get == "all":  # prefill inherits it too
        os.environ["UCX_CUDA_IPC_ENABLE_GET_ZCOPY"] = "y"
    specs = {
        "prefill": EngineSpec(role="prefill", cpu_cores=cores.get("prefill"), nixl_port=port(),
                              **common),
        "decode": EngineSpec(role="decode", cpu_cores=cores.get("decode"), nixl_port=port(),
                             **common),
        "full-media decode": EngineSpec(role="full_media_decode", nixl_port=port(),
                                        cpu_cores=cores.get("full-media decode"), **common),
    }
    if not args.skip_overhead:
        specs["no connector"] = EngineSpec(role="agg", cpu_cores=cores.get("no connector"),
                                           **common)
    # vLLM's own NixlConnector settings (4 UCX threads, NIXL's spinning progress thread): started
    # only for its measurement at the end, since its idle spinning would slow everything else.
    default_spec = EngineSpec(role="full_media_decode", cpu_cores=cores.get("no connector"),
                              nixl_port=port(), nixl_threads=4, nixl_progress_delay_us=0,
                              **common)
    for name, spec in specs.items():
        print(f"[bench] starting {name} engine ...", file=sys.stderr, flush=True)
        before = mem.children()
        engines[name] = start_engine(spec)
        mem.add(name, mem.children() - before)

    prefill = PrefillWorker(engines["prefill"])
    decode = DecodeWorker(engines["decode"], kv_deadline_s=60)
    full = FullMediaDecodeWorker(engines["full-media decode"], kv_deadline_s=60)
    sampling = Sampling(max_tokens=8, temperature=0.0, ignore_eos=True)
    video = args.media == "video"
    sizes = ({"4 s 640x360": (640, 360, 4), "8 s 1280x720": (1280, 720, 8)} if video
             else {"640x480": (640, 480), "12 MP": (4000, 3000)})

    def media(size: tuple, seed: int) -> bytes:
        if video:
            w, h, seconds = size
            return mp4(w, h, 30 * seconds, 30.0, seed)
        return jpeg(*size, seed)

    async def one(arm: str, blob: bytes, rid: str):
        t0 = time.perf_counter()
        if video:
            uri = "data:video/mp4;base64," + base64.b64encode(blob).decode()
            messages = [ChatMessage("user", [VideoPart(VideoURL(uri)), TextPart("Describe it.")])]
        else:
            uri = "data:image/jpeg;base64," + base64.b64encode(blob).decode()
            messages = [user("Describe it.", uri)]
        req = PrefillRequest(request_id=rid, messages=messages,
                             sampling=sampling, first_token=arm == PREFILLS_TOKEN)
        handoff, _ = await asyncio.wait_for(prefill.handoff(req), 120)
        ttft = (time.perf_counter() - t0) * 1e3 if handoff.first_token is not None else None
        if args.verbose:
            print(f"[bench] {rid}: prefill {(time.perf_counter() - t0) * 1e3:.0f} ms",
                  file=sys.stderr, flush=True)
        if arm != "full media":
            wire = encode_handoff(handoff)
            stream = decode.generate(wire)
        else:
            prompt = prefill.prompts.text(req)
            wire = msgspec.msgpack.encode(FullMediaRequest(
                request_id=rid, prompt=prompt, images=[] if video else [blob],
                videos=[blob] if video else [], kv_transfer_params=handoff.kv_transfer_params,
                sampling=sampling))
            stream = full.generate(wire)
        last = None
        async for chunk in stream:
            if ttft is None:
                ttft = (time.perf_counter() - t0) * 1e3
            last = chunk
        st = last.stats
        if args.verbose:
            print(f"[bench] {rid}: first decode token {ttft:.0f} ms, pulled "
                  f"{st.kv_tokens_pulled} of {st.prompt_tokens}", file=sys.stderr, flush=True)
        return ttft, st.prepare_ms, len(wire), st.ttft_ms, st.kv_tokens_pulled, st.prompt_tokens

    rows = []
    for size_name, size in sizes.items():
        n, seed = args.requests, 0
        # a fresh item for every measured request: one seen before would be a prefix-cache hit
        # in prefill, and in the decode engine that served it (no KV pulled at all)
        count = len(ARMS) * n * len(args.concurrency) + 1
        with ThreadPoolExecutor(os.cpu_count()) as pool:  # encoders release the GIL
            images = list(pool.map(lambda i: media(size, 1000 + i), range(count)))
        for conc in args.concurrency:
            for arm in ARMS:
                await one(arm, images[-1], f"warm-{arm}-{size_name}-{conc}")  # warm-up
                results = []
                for start in range(0, n, conc):
                    batch = [one(arm, images[seed + i], f"{arm}-{size_name}-{conc}-{start + i}")
                             for i in range(min(conc, n - start))]
                    results += await asyncio.gather(*batch)
                    seed += len(batch)
                ttfts = [r[0] for r in results]
                firsts = [r[3] for r in results]
                rows.append((size_name, conc, arm, statistics.median(r[1] for r in results),
                             pct(ttfts, 50), pct(ttfts, 95), statistics.median(r[2] for r in results),
                             pct(firsts, 50), pct(firsts, 95),
                             f"{min(r[4] for r in results)}-{max(r[4] for r in results)} "
                             f"of {max(r[5] for r in results)}"))

    print(f"\n## Handoff vs full media ({args.model_shape}, block {args.block_size}, cuda_ipc GET "
          f"{args.cuda_ipc_get}; KV blocks across layers {args.kv_blocks_across_layers}; "
          "TTFT = prefill start to the answer's first token)\n")
    print(f"| {args.media} | conc | arm | decode prep ms | decode first token p50 / p95 ms | TTFT p50 ms "
          "| TTFT p95 ms | decode request bytes | prompt tokens pulled |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r[0]} | {r[1]} | {r[2]} | {r[3]:.2f} | {r[7]:.1f} / {r[8]:.1f} | {r[4]:.1f} "
              f"| {r[5]:.1f} | {r[6]:,.0f} | {r[9]} |")
    print(f"\n| {args.media} | conc | handoff/full decode first token p50 | handoff/full TTFT p50 "
          "| TTFT p50 reduction | handoff/full request bytes | prefill's token/handoff TTFT p50 |")
    print("|---|---|---|---|---|---|---|")
    for i in range(0, len(rows), len(ARMS)):
        f, hnd, new = rows[i:i + len(ARMS)]
        print(f"| {f[0]} | {f[1]} | {hnd[7] / f[7]:.2f} | {hnd[4] / f[4]:.2f} "
              f"| {100 * (1 - hnd[4] / f[4]):.0f}% | {hnd[6] / f[6]:.5f} ({100 * hnd[6] / f[6]:.3f}%) "
              f"| {new[4] / hnd[4]:.2f} |")
    if args.skip_overhead:
        return

    print("\n## NixlConnector overhead (text prompt, 8 output tokens, sequential, core 1)\n")

    async def latency(name: str) -> float:
        times = []
        for i in range(args.requests * 2 + 1):
            t0 = time.perf_counter()
            async for _ in engines[name].llm.generate(
                    {"prompt": f"Count to ten, number {i}."},
                    sampling_params(Sampling(max_tokens=8, temperature=0, ignore_eos=True)),
                    f"lat-{name}-{i}"):
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


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=8, help="requests per arm and setting")
    parser.add_argument("--quick", action="store_true",
                        help="skip the engine with vLLM's default NIXL settings")
    parser.add_argument("--verbose", action="store_true", help="a line per request phase")
    parser.add_argument("--skip-overhead", action="store_true",
                        help="skip the NixlConnector overhead section (CPU-specific)")
    parser.add_argument("--model-shape", default="tiny",
                        choices=("tiny", "tiny-qwen2-vl", "tiny-qwen2.5-vl", "llava-1.5-7b",
                                 "qwen2.5-vl-7b"),
                        help="tiny: the built-in random LLaVA; tiny-qwen2-vl, tiny-qwen2.5-vl: "
                             "the built-in random Qwen-VL (M-RoPE); else a real-size shape with "
                             "random weights (mmhandoff.models.dummy; for GPUs)")
    parser.add_argument("--enforce-eager", action="store_true",
                        help="a real-size shape: no CUDA graphs or compilation (each engine up "
                             "in ~25 s on an H100 instead of minutes: docs/benchmarks.md)")
    parser.add_argument("--max-model-len", type=int, default=None,
                        help="a real-size shape: the engines' context (default: the model's)")
    parser.add_argument("--media", choices=("image", "video"), default="image",
                        help="video: two generated clips (a Qwen-VL model only)")
    parser.add_argument("--concurrency", type=lambda s: [int(x) for x in s.split(",")],
                        default=[1, 4], help="comma-separated, e.g. 1,8")
    parser.add_argument("--block-size", type=int, default=32)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.25,
                        help="GPU: each engine's share (three engines share one GPU)")
    parser.add_argument("--cuda-ipc-get", choices=("on", "off", "all"), default="on",
                        help="GPU: UCX_CUDA_IPC_ENABLE_GET_ZCOPY=y for the decode engines (on, "
                             "EngineSpec's default), UCX's auto (off), or y for every process "
                             "(all: how the first prefill hung, docs/gpu.md)")
    parser.add_argument("--kv-blocks-across-layers", choices=("on", "off"), default="on",
                        help="GPU: one NIXL descriptor per KV block, all layers (on: "
                             "EngineSpec's default), or one per layer and K/V (off: vLLM's)")
    asyncio.run(main(parser.parse_args()))
    # The engines are shut down and the results printed. Ending here skips the interpreter's
    # teardown, in which AsyncLLM.__del__ shuts each engine down again and fails on module
    # globals already gone (three "Exception ignored" tracebacks after the tables).
    sys.stdout.flush()
    os._exit(0)
