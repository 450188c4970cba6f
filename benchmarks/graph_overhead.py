"""Graph overhead: the disagg graph through the HTTP frontend vs the same handoff in-process.

    .venv/bin/python benchmarks/graph_overhead.py [--requests 32] [--rounds 3]
    # a GPU: a real-size shape with dummy weights, each of the 4 engines a share of the GPU
    python benchmarks/graph_overhead.py --model-shape llava-1.5-7b --gpu-memory-utilization 0.2

Arms (same engine settings, same cores, same images, distinct per request so no prefix cache
helps any arm), each under both contracts: the answer's first token from prefill (the
product's: the client has it when prefill answers, decode continues after it) and from decode
(the older: after the handoff, the KV pull and a decode step):
- in-process: PrefillWorker.handoff -> DecodeWorker.generate in this process (no runtime, no HTTP);
- graph:      `mmhandoff serve graphs.disagg:Frontend -f configs/disagg.yaml`, streaming chat
              requests over HTTP: frontend checks, Dynamo TCP to prefill and to decode, SSE. The
              older contract's arm is a second frontend, serve's own command line with
              `--first-token-from decode`, in front of the same workers.
All arms are up together and take turns, round by round (idle CPU is printed). Per arm and
concurrency (1 and 8): TTFT p50/p95 (request sent to first token received) and throughput
(requests/s); then, per contract, the graph's added TTFT p50 in ms (the target: at most 5 ms
with prefill's token) and the throughput ratio, and the new contract's graph TTFT p50 over the
older one's (the target: at most 0.75).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import functools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("UCX_NET_DEVICES", "lo")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

from benchmarks.common import jpeg, pct, port  # noqa: E402

MAX_TOKENS = 32
# the answer's first token: {contract: PrefillRequest.first_token}
CONTRACTS = {"prefill's token": True, "decode's token": False}


def messages(image: bytes) -> list[dict]:
    """OpenAI's form: the graph arm posts it; the in-process arm reads it as the frontend does."""
    uri = "data:image/jpeg;base64," + base64.b64encode(image).decode()
    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": uri}},
                                         {"type": "text", "text": "Describe it."}]}]


def model_settings(args) -> tuple[str, dict]:
    """The model folder and the engine arguments both arms use (beyond `launch`'s defaults)."""
    if args.model_shape == "tiny":
        from mmhandoff.models.tiny import ensure_tiny_model

        return str(ensure_tiny_model()), {}
    from mmhandoff.models.dummy import ensure_dummy_model

    extra = {"load_format": "dummy", "dtype": "bfloat16"}
    if args.gpu_memory_utilization is not None:
        extra["gpu_memory_utilization"] = args.gpu_memory_utilization
    return str(ensure_dummy_model(args.model_shape)), extra


class InProcess:
    def __init__(self, args) -> None:
        from mmhandoff.decode.worker import DecodeWorker
        from mmhandoff.prefill.worker import PrefillWorker
        from mmhandoff.vllm_adapter import EngineSpec, start_engine

        model, extra = model_settings(args)  # the settings `launch` gives the graph's workers
        self.engines = [start_engine(EngineSpec(model=model, role=role, cpu_cores=core,
                                                nixl_port=port(), extra=extra))
                        for role, core in (("prefill", "0"), ("decode", "1"))]
        self.prefill = PrefillWorker(self.engines[0])
        self.decode = DecodeWorker(self.engines[1])

    async def request(self, rid: str, image: bytes, first_token: bool) -> float:
        import msgspec

        from mmhandoff.wire.handoff import Sampling
        from mmhandoff.wire.messages import ChatMessage, PrefillRequest

        t0 = time.perf_counter()
        handoff, _ = await self.prefill.handoff(PrefillRequest(
            request_id=rid, messages=msgspec.convert(messages(image), list[ChatMessage]),
            sampling=Sampling(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True),
            first_token=first_token))
        ttft = time.perf_counter() - t0 if first_token else None
        async for _ in self.decode.generate(handoff):
            ttft = ttft or time.perf_counter() - t0
        return ttft

    def close(self) -> None:
        for e in self.engines:
            e.shutdown()
        # dropped now, while the interpreter is whole: AsyncLLM.__del__ shuts down again and
        # fails with a TypeError when it runs at interpreter exit
        self.engines.clear()
        self.prefill = self.decode = None


def graph_config(args, run_dir: Path) -> Path:
    """configs/disagg.yaml with the benchmark's model and engine arguments."""
    import yaml

    config = yaml.safe_load((ROOT / "configs/disagg.yaml").read_text())
    model, extra = model_settings(args)
    config["model"] = model
    for worker in ("prefill", "decode"):
        for name, value in extra.items():
            config["components"][worker]["args"] += ["--engine-arg",
                                                     f"{name}={json.dumps(value)}"]
    path = run_dir / "disagg.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def _wait_healthy(url: str, proc: subprocess.Popen, timeout_s: float, what: str,
                  log: Path) -> None:
    """Until `url`/health answers; `proc` must not exit meanwhile."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"{what} exited; see {log}"
        try:
            urllib.request.urlopen(url + "/health", timeout=2).close()
            return
        except OSError:
            time.sleep(0.5)
    raise TimeoutError(f"{what} was not ready in {timeout_s:.0f} s; see {log}")


class Graph:
    def __init__(self, config: Path, log: Path) -> None:
        self.older = None  # the older contract's frontend (start_older_frontend)
        self.port = port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = open(log, "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "mmhandoff", "serve", "graphs.disagg:Frontend", "-f",
             str(config), "--port", str(self.port)],
            cwd=ROOT, stdout=self.log, stderr=subprocess.STDOUT)
        _wait_healthy(self.url, self.proc, 600, "the graph", log)

    def start_older_frontend(self, log: Path) -> None:
        """A second frontend in front of the same workers, with the older contract: serve's
        frontend's own command line and environment, another port, `--first-token-from
        decode`."""
        import psutil

        (ours,) = [p for p in psutil.Process(self.proc.pid).children()
                   if "mmhandoff.frontend" in p.cmdline()]
        older_port = port()
        self.older_url = f"http://127.0.0.1:{older_port}"
        self.older_log = open(log, "w")
        # the last --port counts (serve's own override comes after the config's)
        self.older = subprocess.Popen(
            [*ours.cmdline(), "--port", str(older_port), "--first-token-from", "decode"],
            cwd=ROOT, env=ours.environ(), stdout=self.older_log, stderr=subprocess.STDOUT)
        _wait_healthy(self.older_url, self.older, 120, "the second frontend", log)

    async def request(self, session, rid: str, image: bytes, first_token: bool) -> float:
        # The body is encoded before the clock starts: a client's own JSON encoding (~0.3-0.5 ms
        # for the 200 KB body) is not something the graph adds.
        body = json.dumps({"model": "tiny-llava", "messages": messages(image),
                           "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
                           "stream": True}).encode()
        url = self.url if first_token else self.older_url
        t0 = time.perf_counter()
        ttft = None
        async with session.post(url + "/v1/chat/completions", data=body,
                                headers={"Content-Type": "application/json"}) as response:
            assert response.status == 200, await response.text()
            async for line in response.content:
                if line.startswith(b"data: {") and ttft is None:
                    ttft = time.perf_counter() - t0
                    assert "error" not in json.loads(line[6:])
        return ttft

    def close(self) -> None:
        if self.older is not None:
            self.older.terminate()
            self.older.wait(timeout=60)
            self.older_log.close()
        self.proc.terminate()
        self.proc.wait(timeout=90)
        self.log.close()


async def batch(request, images: list[bytes], concurrency: int, tag: str):
    """TTFTs (s) and requests/s of `images` sent with at most `concurrency` in flight."""
    gate = asyncio.Semaphore(concurrency)

    async def one(i, image):
        async with gate:
            return await request(f"{tag}-{i}", image)

    t0 = time.perf_counter()
    ttfts = await asyncio.gather(*(one(i, im) for i, im in enumerate(images)))
    return list(ttfts), len(images) / (time.perf_counter() - t0)


async def measure(arms: dict, args) -> dict:
    """Warm-up, then `rounds` rounds; in each, both arms at concurrency 1, then both at 8, so the
    machine's drift hits both alike. {arm: {conc: (ttfts, [req/s per round])}}."""
    for tag, request in arms.items():
        for c in (1, 8):  # a fresh engine's (and graph's) first requests are slow
            await batch(request, [jpeg(640, 480, 90 + 10 * c + i) for i in range(8)], c,
                        f"warm-{tag}")
            print(f"warm-up done: {tag}, concurrency {c}", flush=True)
    out = {tag: {1: ([], []), 8: ([], [])} for tag in arms}
    for r in range(args.rounds):
        for c in (1, 8):
            n = args.requests if c == 8 else max(8, args.requests // 4)
            for a, (tag, request) in enumerate(arms.items()):  # distinct images per arm
                images = [jpeg(640, 480, 100_000 * a + 1000 * (r + 1) + 100 * c + i)
                          for i in range(n)]
                ttfts, rps = await batch(request, images, c, f"{tag}-{r}-{c}")
                out[tag][c][0].extend(ttfts)
                out[tag][c][1].append(rps)
        print(f"round {r + 1}/{args.rounds} done", flush=True)
    return out


async def idle_cpu(pids: list[int], seconds: float = 3.0) -> float:
    """Cores used by these processes and their children over `seconds` of no requests."""
    import psutil

    procs = [p for pid in pids for p in (psutil.Process(pid),
                                          *psutil.Process(pid).children(recursive=True))]
    before = sum(sum(p.cpu_times()[:2]) for p in procs)
    await asyncio.sleep(seconds)
    return (sum(sum(p.cpu_times()[:2]) for p in procs) - before) / seconds


async def main(args) -> None:
    import aiohttp

    run_dir = Path(tempfile.mkdtemp(prefix="mmhandoff-bench-"))
    # Both arms stay up and take turns: with the engines' spin plugin
    # (components/src/mmhandoff/vllm_adapter/plugins/spin.py) the idle arm uses a few percent of a core (printed).
    print("in-process arm: starting the engines", flush=True)
    local = InProcess(args)  # on this loop: AsyncLLM binds its output handler to it
    print(f"graph arm: starting the graph (log: {run_dir}/graph.log)", flush=True)
    graph = Graph(graph_config(args, run_dir), run_dir / "graph.log")
    session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300))
    try:
        graph.start_older_frontend(run_dir / "frontend-older.log")
        idle = {"in-process engines": await idle_cpu(
                    [pid for e in local.engines for pid in e.core_pids()]),
                "graph": await idle_cpu([graph.proc.pid, graph.older.pid])}
        arms = {}
        for contract, first_token in CONTRACTS.items():
            arms[f"in-process, {contract}"] = functools.partial(
                local.request, first_token=first_token)
            arms[f"graph, {contract}"] = functools.partial(
                graph.request, session, first_token=first_token)
        results = await measure(arms, args)
    finally:
        await session.close()
        graph.close()
        local.close()

    print("\nidle CPU while the other arm waits: " +
          ", ".join(f"{k} {v:.3f} cores" for k, v in idle.items()))
    print(f"\n640x480 JPEG, {MAX_TOKENS} output tokens, model {args.model_shape}; "
          f"{args.rounds} rounds\n")
    print("| concurrency | arm | requests | TTFT p50 ms | TTFT p95 ms | requests/s |")
    print("|---|---|---|---|---|---|")
    for c in (1, 8):
        for arm, by_conc in results.items():
            ttfts, rps = by_conc[c]
            print(f"| {c} | {arm} | {len(ttfts)} | {pct(ttfts, 50) * 1e3:.1f} | "
                  f"{pct(ttfts, 95) * 1e3:.1f} | {statistics.median(rps):.2f} |")
    print()
    for c in (1, 8):
        for contract in CONTRACTS:
            local, graph = results[f"in-process, {contract}"][c], results[f"graph, {contract}"][c]
            local_ttft, graph_ttft = pct(local[0], 50), pct(graph[0], 50)
            ratio = statistics.median(graph[1]) / statistics.median(local[1])
            print(f"concurrency {c}, {contract}: graph adds {(graph_ttft - local_ttft) * 1e3:+.1f}"
                  f" ms to TTFT p50 (ratio {graph_ttft / local_ttft:.2f}); throughput ratio "
                  f"graph/in-process {ratio:.2f}")
        new, older = (pct(results[f"graph, {k}"][c][0], 50) for k in CONTRACTS)
        print(f"concurrency {c}: graph TTFT p50, {'/'.join(CONTRACTS)}: {new / older:.2f}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=32, help="requests per round at conc 8")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--model-shape", default="tiny", choices=["tiny", "llava-1.5-7b"],
                        help="tiny: the test model; else a real-size shape, dummy weights")
    parser.add_argument("--gpu-memory-utilization", type=float,
                        help="GPU: each engine's share (four engines share one GPU)")
    asyncio.run(main(parser.parse_args()))
