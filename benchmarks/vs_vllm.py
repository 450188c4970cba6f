"""mmhandoff against the anchors on one GPU: plain `vllm serve`, vLLM's own P/D (NixlConnector and
the two-step proxy), mmhandoff's agg and disagg graphs; same model, same client, same images.

    python benchmarks/vs_vllm.py [--arms vllm,vllm-pd,agg,disagg] [--out results.json]
    python benchmarks/vs_vllm.py --report a.json b.json      # the tables and ratios of runs

Arms, one up at a time, each with what its own configuration gives it on one GPU:
- vllm:    `vllm serve` (the OpenAI server), vLLM's defaults but the dummy weights;
- vllm-pd: two `vllm serve`, prefill (kv_producer) and decode (kv_consumer, cuda_ipc GET on as
           docs/gpu.md says), 0.45 of the GPU each, started one after the other; the client does
           the toy proxy's two steps: prefill with max_tokens 1 and `do_remote_decode`, then decode
           with the same request and prefill's `kv_transfer_params` (decode re-processes the
           image, as vLLM's P/D does);
- agg:     `mmhandoff serve graphs.agg:Frontend -f configs/gpu/agg.yaml`;
- disagg:  `mmhandoff serve graphs.disagg:Frontend -f configs/gpu/disagg.yaml` (prefill and decode
           share the GPU, 0.45 each);
- agg-parallel: the agg graph with `--engine-arg renderer_num_workers=8` (8 threads process
           images, and vLLM keeps no processed-image cache) instead of the default (vLLM's one
           thread, with its cache);
- agg-threads, disagg-threads: the graph with `--renderer-torch-threads auto` on the engine
           that processes images (one request's image on up to 8 torch threads; vLLM's one
           renderer thread and its cache kept).
The shipped configs as they are: no engine argument is passed by hand. The client (aiohttp,
streaming chat, greedy, `ignore_eos`, MAX_TOKENS output tokens) sends distinct JPEGs (no prefix
cache helps), at 640x480 and 12 MP, at 1, 8 and 32 in flight (12 MP: 1 and 8), then the 12 MP
C1 cell's images once more (a follow-up turn about the same image). Per cell: TTFT
p50/p95 (request sent to the first content token received), inter-token p50 (each request's mean
gap between content chunks), requests/s. Then the issue's ratios: disagg / vLLM P/D requests/s
(target >= 1.0 in every cell), disagg / vLLM P/D TTFT p50 at 12 MP (<= 0.75), agg / vllm serve
requests/s at C8 and C32 (>= 0.95).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.common import jpeg, pct, port  # noqa: E402

MAX_TOKENS = 32
MODEL_NAME = "llava-1.5-7b"
SHAPE = "llava-1.5-7b"
CELLS = [("640x480", 1, 8), ("640x480", 8, 32), ("640x480", 32, 64),
         ("12MP", 1, 6), ("12MP", 8, 16)]  # (image, concurrency, requests)
SIZES = {"640x480": (640, 480), "12MP": (4000, 3000)}
ARMS = ("vllm", "vllm-pd", "agg", "disagg", "agg-parallel", "agg-threads", "disagg-threads",
        "agg-inline", "disagg-inline", "disagg-cache", "agg-draft", "disagg-draft",
        "agg-nagle", "disagg-nagle")
# variants of a shipped graph (issue 37): the arguments its image-processing component gets
# on top of the config's. agg-parallel: 8 threads processing images (vLLM then keeps no
# processed-image cache) instead of vLLM's one thread and its cache; *-threads: each image on
# up to 8 torch threads; *-inline: images prepared in the worker's threads, not in media
# processes (media.pool); disagg-cache: prefill's renderer on vLLM's one thread with its cache;
# *-draft: JPEGs decoded at a reduced scale (the inexact decode, off by default)
TORCH_THREADS = ["--renderer-torch-threads", "auto"]
INLINE = ["--media-workers", "0"]
DRAFT = ["--image-decode", "draft"]
VARIANTS = {"agg-parallel": ("agg", ["--engine-arg", "renderer_num_workers=8"]),
            "agg-threads": ("agg", TORCH_THREADS), "disagg-threads": ("prefill", TORCH_THREADS),
            "agg-inline": ("agg", INLINE), "disagg-inline": ("prefill", INLINE),
            "disagg-cache": ("prefill", ["--engine-arg", "renderer_num_workers=1"]),
            "agg-draft": ("agg", DRAFT), "disagg-draft": ("prefill", DRAFT)}
# *-nagle: the graph with Dynamo's request-plane sockets as ai-dynamo-runtime 1.6 leaves them
# (Nagle on where the server accepted: plane/nodelay.py), the graph's own environment otherwise
ENV_VARIANTS = {f"{g}-nagle": {"MMHANDOFF_REQUEST_PLANE_NODELAY": "0"} for g in ("agg", "disagg")}
AGAIN = "12MP C1 again"  # the 12 MP C1 cell's images once more: a follow-up turn's TTFT
PD_SHARE = 0.45  # as configs/gpu/disagg.yaml's engines on one GPU


PROFILED = ("640x480", 32, 128)  # --profile: this cell again, under py-spy


def images(profiled=PROFILED) -> dict[str, list[str]]:
    """Distinct data URIs per image size: enough for every cell plus a warm-up (and the profiled
    cell), shared by the arms (each arm's engines are fresh, so no arm finds another's images
    cached)."""
    out = {}
    for size, (w, h) in SIZES.items():
        n = sum(r for s, _, r in CELLS if s == size) + 4
        n += profiled[2] if size == profiled[0] else 0
        out[size] = ["data:image/jpeg;base64," + base64.b64encode(jpeg(w, h, 7000 + i)).decode()
                     for i in range(n)]
    return out


def body(uri: str, **kw) -> dict:
    return {"model": MODEL_NAME, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
            "stream": True, "messages": [{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": uri}},
                {"type": "text", "text": "Describe the picture."}]}], **kw}


class Server:
    """A process group of ours (a `vllm serve` or a `mmhandoff serve`) answering on `port`."""

    def __init__(self, name: str, command: list[str], port_: int, log_dir: Path,
                 env: dict[str, str] | None = None) -> None:
        self.name, self.url = name, f"http://127.0.0.1:{port_}"
        self.log_path = log_dir / f"{name}.log"
        self.log = open(self.log_path, "w")
        self.t0 = time.monotonic()
        self.proc = subprocess.Popen(command, cwd=ROOT, stdout=self.log,
                                     stderr=subprocess.STDOUT, start_new_session=True,
                                     env={**os.environ, **(env or {})})

    def wait(self, timeout_s: float = 600) -> float:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise SystemExit(f"{self.name} exited ({self.proc.returncode}):\n"
                                 + self.log_path.read_text()[-3000:])
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return time.monotonic() - self.t0
            except OSError:
                pass
            time.sleep(1)
        raise SystemExit(f"{self.name} not ready in {timeout_s:.0f} s")

    def stop(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(timeout=90)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        except ProcessLookupError:
            pass
        _wait_session_gone(self.proc.pid)
        self.log.close()


def _wait_session_gone(sid: int, timeout_s: float = 60) -> None:
    """The engine processes free the GPU only once they are gone: the next arm needs it whole."""
    import psutil

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        left = [p for p in psutil.process_iter() if _sid(p.pid) == sid]
        if not left:
            return
        time.sleep(0.5)
    for p in psutil.process_iter():
        if _sid(p.pid) == sid:
            p.kill()


def _sid(pid: int) -> int | None:
    try:
        return os.getsid(pid)
    except OSError:
        return None


def vllm_command(model: str, p: int, share: float | None, role: str | None) -> list[str]:
    command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
               "--load-format", "dummy", "--dtype", "bfloat16", "--port", str(p),
               "--served-model-name", MODEL_NAME]
    if share is not None:
        command += ["--gpu-memory-utilization", str(share)]
    if role is not None:
        command += ["--kv-transfer-config", json.dumps(
            {"kv_connector": "NixlConnector", "kv_role": role})]
    return command


def start_arm(arm: str, model: str, log_dir: Path) -> tuple[list[Server], float]:
    """The arm's servers, up; and how long they took to start."""
    t0 = time.monotonic()
    if arm == "vllm":
        servers = [Server("vllm", vllm_command(model, p := port(), None, None), p, log_dir)]
        servers[0].wait()
    elif arm == "vllm-pd":
        servers = []
        for role, name in (("kv_producer", "vllm-prefill"), ("kv_consumer", "vllm-decode")):
            env = {"VLLM_NIXL_SIDE_CHANNEL_PORT": str(port()), "UCX_NET_DEVICES": "lo"}
            if role == "kv_consumer":
                env["UCX_CUDA_IPC_ENABLE_GET_ZCOPY"] = "y"
            servers.append(Server(name, vllm_command(model, p := port(), PD_SHARE, role), p,
                                  log_dir, env))
            servers[-1].wait()  # one after the other: vLLM sizes its KV from free memory
    else:
        p, graph, config = port(), arm.split("-")[0], f"configs/gpu/{arm.split('-')[0]}.yaml"
        if arm in VARIANTS:
            import yaml

            component, extra = VARIANTS[arm]
            spec = yaml.safe_load(Path(config).read_text())
            part = spec["components"][component]
            part["args"] = [*part.get("args", []), *extra]
            config = str(log_dir / f"{arm}.yaml")
            Path(config).write_text(yaml.safe_dump(spec))
        servers = [Server(arm, [sys.executable, "-m", "mmhandoff", "serve",
                                f"graphs.{graph}:Frontend", "-f", config,
                                "--port", str(p)], p, log_dir, ENV_VARIANTS.get(arm))]
        servers[0].wait(900)
    return servers, time.monotonic() - t0


JSON = {"Content-Type": "application/json"}


def encoded(arm: str, uri: str) -> tuple[bytes, bytes | None]:
    """The request's body, and vLLM P/D's first step's, as JSON bytes: made before the cell's
    clock starts (a 12 MP data URI's 7.8 MB take the client's one loop ~20 ms to encode: eight
    at once delayed the eighth by the other seven's, the load generator's time, not the
    server's; runs before 2026-12-07's last counted it)."""
    first = None
    if arm == "vllm-pd":  # the toy proxy's first step
        first = json.dumps(body(uri, max_tokens=1, stream=False, kv_transfer_params={
            "do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
            "remote_block_ids": None, "remote_host": None, "remote_port": None})).encode()
    return json.dumps(body(uri)).encode(), first


async def one_request(session, arm: str, servers: list[Server], uri: str,
                      payload: tuple[bytes, bytes | None]) -> tuple[float, float, dict | None]:
    """(TTFT s, mean inter-token gap s, the answer's `mmhandoff` statistics or None) of one
    streamed answer; `payload`: `encoded(arm, uri)`."""
    t0 = time.perf_counter()
    target = servers[-1].url
    data, first = payload
    if first is not None:  # the proxy's second step carries the first's answer
        async with session.post(servers[0].url + "/v1/chat/completions", data=first,
                                headers=JSON) as r:
            assert r.status == 200, await r.text()
            request = body(uri)
            request["kv_transfer_params"] = (await r.json())["kv_transfer_params"]
            data = json.dumps(request).encode()
    times, stats = [], None
    async with session.post(target + "/v1/chat/completions", data=data, headers=JSON) as r:
        assert r.status == 200, await r.text()
        async for line in r.content:
            if not line.startswith(b"data: {"):
                continue
            chunk = json.loads(line[6:])
            assert "error" not in chunk, chunk
            stats = chunk.get("mmhandoff", stats)
            if any(c.get("delta", {}).get("content") for c in chunk.get("choices", ())):
                times.append(time.perf_counter())
    assert times, "no content"
    gaps = (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else 0.0
    return times[0] - t0, gaps, stats


def breakdown(ttft_s: float, stats: dict | None) -> dict[str, float] | None:
    """Where an mmhandoff answer's TTFT went (ms), from the worker's own clocks: loading the
    media (decode, hash, presize), the rest of the preparation (the engine's render), the engine
    up to the first token, and what is outside the worker (client, frontend, the plane)."""
    if not stats:
        return None
    first = stats.get("prefill") or stats  # disagg: prefill's first token
    if first.get("media_ms", -1) < 0:
        return None
    worker_ms = (first["prepare_ms"] + first["prefill_ms"] if "prefill_ms" in first
                 else first["ttft_ms"])
    return {"media_ms": first["media_ms"], "render_ms": first["prepare_ms"] - first["media_ms"],
            "engine_ms": worker_ms - first["prepare_ms"], "outside_ms": ttft_s * 1e3 - worker_ms}


async def cell(session, arm, servers, uris: list[str], concurrency: int) -> dict:
    gate = asyncio.Semaphore(concurrency)

    payloads = {uri: encoded(arm, uri) for uri in uris}

    async def one(uri):
        async with gate:
            return await one_request(session, arm, servers, uri, payloads[uri])

    t0 = time.perf_counter()
    results = await asyncio.gather(*(one(u) for u in uris))
    wall = time.perf_counter() - t0
    ttfts = [r[0] for r in results]
    out = {"requests": len(uris), "ttft_p50_ms": pct(ttfts, 50) * 1e3,
           "ttft_p95_ms": pct(ttfts, 95) * 1e3,
           "itl_p50_ms": statistics.median(r[1] for r in results) * 1e3,
           "rps": len(uris) / wall}
    parts = [b for b in (breakdown(r[0], r[2]) for r in results) if b is not None]
    if len(parts) == len(results):  # medians of each part (they need not add up to the TTFT's)
        out.update({f"p50_{k}": statistics.median(p[k] for p in parts) for k in parts[0]})
    return out


def start_profilers(servers: list[Server], out_dir: Path, arm: str) -> list:
    """py-spy on every Python process of the arm's servers that serves requests (collapsed
    stacks: `py-spy record --format raw`), until stopped."""
    import psutil

    procs = []
    for server in servers:
        for p in [psutil.Process(server.proc.pid), *psutil.Process(server.proc.pid).children(
                recursive=True)]:
            line = " ".join(p.cmdline())
            role = next((r for r in ("frontend", "agg", "prefill", "decode", "api_server")
                         if f"mmhandoff.{r}" in line or f"openai.{r}" in line), None)
            if role is None and "spawn_main" in line:  # a worker's media process (media.pool)
                parent = " ".join(p.parent().cmdline())
                owner = next((r for r in ("agg", "prefill") if f"mmhandoff.{r}" in parent), None)
                role = None if owner is None else f"{owner}-media-{p.pid}"
            if role is None or "VLLM" in p.name():
                continue
            procs.append(subprocess.Popen(
                ["py-spy", "record", "--format", "raw", "--rate", "200", "--nonblocking",
                 "--pid", str(p.pid), "-o", str(out_dir / f"profile-{server.name}-{role}.txt")],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    return procs


def py_spy_on_path() -> bool:
    """py-spy runnable, installed first from the bundle's wheel if need be (a lent GPU machine
    has none of its own: the profiling call of 2026-12-07 failed on it after its first arm)."""
    import glob
    import shutil

    if shutil.which("py-spy"):
        return True
    wheels = glob.glob(str(ROOT / ".gpu-bundle" / "debug" / "py_spy-*.whl"))
    if not wheels:
        return False
    target = Path(tempfile.gettempdir()) / "mmhandoff-py-spy"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps",
                    "--target", str(target), wheels[0]], check=True)
    os.environ["PATH"] = f"{target / 'bin'}:{os.environ['PATH']}"
    return shutil.which("py-spy") is not None


def stop_profilers(procs: list) -> None:
    for p in procs:
        p.send_signal(signal.SIGINT)  # py-spy writes its file on SIGINT
    for p in procs:
        try:
            p.wait(timeout=60)
        except subprocess.TimeoutExpired:
            p.kill()


async def run_arm(arm: str, model: str, pool: dict, log_dir: Path,
                  profile: Path | None = None, profiled=PROFILED, sizes=tuple(SIZES)) -> dict:
    import aiohttp

    print(f"[vs_vllm] {arm}: starting", flush=True)
    servers, start_s = start_arm(arm, model, log_dir)
    print(f"[vs_vllm] {arm}: up in {start_s:.0f} s", flush=True)
    out = {"start_s": start_s, "cells": {}}
    try:
        # a fresh connection per request, for every arm alike: a pooled keep-alive connection
        # that the server had closed failed a 12 MP POST with "Broken pipe" (vLLM P/D, H100)
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600),
                                         connector=aiohttp.TCPConnector(force_close=True)
                                         ) as session:
            for size in sizes:  # warm-up: the first requests of a fresh engine are slow
                await cell(session, arm, servers, pool[size][:4], 4)
            used = {size: 4 for size in SIZES}
            again = None
            for size, conc, n in CELLS:
                if size not in sizes:
                    continue
                uris = pool[size][used[size]:used[size] + n]
                used[size] += n
                again = uris if (size, conc) == ("12MP", 1) else again
                out["cells"][f"{size} C{conc}"] = await cell(session, arm, servers, uris, conc)
            if again is not None:
                out["cells"][AGAIN] = await cell(session, arm, servers, again, 1)
            for name, result in out["cells"].items():
                print(f"[vs_vllm] {arm} {name}: " + ", ".join(
                    f"{k} {v:.1f}" for k, v in result.items()), flush=True)
            if profile is not None:
                size, conc, n = profiled
                profilers = start_profilers(servers, profile, arm)
                try:
                    result = await cell(session, arm, servers,
                                        pool[size][used[size]:used[size] + n], conc)
                finally:
                    stop_profilers(profilers)
                out["profiled"] = result
                print(f"[vs_vllm] {arm} profiled {size} C{conc}: {result}", flush=True)
    finally:
        for s in reversed(servers):
            s.stop()
    return out


def report(results: dict) -> None:
    cells = [f"{s} C{c}" for s, c, _ in CELLS] + [AGAIN]
    arms = [a for a in ARMS if a in results]
    print(f"\n{MAX_TOKENS} output tokens, {SHAPE} shape (dummy weights, bf16), one GPU\n")
    print("| arm | start s | " + " | ".join(f"{c} TTFT p50/p95 ms, ITL ms, req/s"
                                            for c in cells) + " |")
    print("|---|---|" + "---|" * len(cells))
    for arm in arms:
        r = results[arm]["cells"]
        print(f"| {arm} | {results[arm]['start_s']:.0f} | " + " | ".join(
            f"{r[c]['ttft_p50_ms']:.0f} / {r[c]['ttft_p95_ms']:.0f}, {r[c]['itl_p50_ms']:.1f}, "
            f"{r[c]['rps']:.2f}" if c in r else "-" for c in cells) + " |")

    def ratio(a, b, c, key):
        try:
            return results[a]["cells"][c][key] / results[b]["cells"][c][key]
        except KeyError:
            return float("nan")

    print()
    for c in cells:
        line = [f"{c}:"]
        if {"disagg", "vllm-pd"} <= set(arms):
            line.append(f"disagg/vLLM P/D req/s {ratio('disagg', 'vllm-pd', c, 'rps'):.2f} "
                        f"(>= 1.0), TTFT p50 {ratio('disagg', 'vllm-pd', c, 'ttft_p50_ms'):.2f}"
                        + (" (<= 0.75)" if c.startswith("12MP") else ""))
        if {"agg", "vllm"} <= set(arms):
            line.append(f"agg/vllm serve req/s {ratio('agg', 'vllm', c, 'rps'):.2f}"
                        + (" (>= 0.95)" if c.endswith(("C8", "C32")) else ""))
        bases = {v: "disagg" if component == "prefill" else "agg"
                 for v, (component, _) in VARIANTS.items()}
        for variant, base in {**bases, **{v: v.split("-")[0] for v in ENV_VARIANTS}}.items():
            if {base, variant} <= set(arms):
                line.append(f"{variant}/{base} TTFT p50 "
                            f"{ratio(variant, base, c, 'ttft_p50_ms'):.2f}")
        print(" ".join(line))
    # issue 37: how a 12 MP request's TTFT holds up with 8 in flight, per arm
    c1, c8 = "12MP C1", "12MP C8"
    scaling = []
    for arm in arms:
        r = results[arm]["cells"]
        if {c1, c8} <= set(r):
            scaling.append(f"{arm} {r[c8]['ttft_p50_ms'] / r[c1]['ttft_p50_ms']:.2f}")
    if scaling:
        print("12MP TTFT p50 C8 / C1 (<= 1.3): " + ", ".join(scaling))
    parts = ("media", "render", "engine", "outside")
    for arm in arms:
        for c, r in results[arm]["cells"].items():
            if "p50_media_ms" in r:
                print(f"{arm} {c} TTFT parts p50 ms: " + ", ".join(
                    f"{k} {r[f'p50_{k}_ms']:.0f}" for k in parts))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arms", default=",".join(ARMS))
    parser.add_argument("--out", help="write the results (JSON) here too")
    parser.add_argument("--profile", metavar="DIR",
                        help="after the cells, run one cell again (--profile-cell) with py-spy on "
                             "each serving process (collapsed stacks into DIR)")
    parser.add_argument("--profile-cell", metavar="SIZE,CONC,N",
                        default=",".join(map(str, PROFILED)),
                        help="the cell --profile runs again: image size, concurrency, requests "
                             "(default %(default)s)")
    parser.add_argument("--report", nargs="+", metavar="JSON",
                        help="print the tables of earlier runs' results, merged")
    parser.add_argument("--sizes", default=",".join(SIZES),
                        help=f"the cells of these image sizes only (of {', '.join(SIZES)})")
    args = parser.parse_args(argv)
    if args.report:
        merged = {}
        for path in args.report:
            merged.update(json.loads(Path(path).read_text()))
        report(merged)
        return 0
    arms = args.arms.split(",")
    sizes = tuple(args.sizes.split(","))
    if set(sizes) - set(SIZES):
        parser.error(f"--sizes: unknown {sorted(set(sizes) - set(SIZES))}; known: "
                     f"{', '.join(SIZES)}")
    size, conc, n = args.profile_cell.split(",")
    if size not in SIZES:
        parser.error(f"--profile-cell: unknown size {size}; known: {', '.join(SIZES)}")
    profiled = (size, int(conc), int(n))
    unknown = set(arms) - set(ARMS)
    if unknown:
        parser.error(f"unknown arms {sorted(unknown)}; known: {', '.join(ARMS)}")
    if args.profile and not py_spy_on_path():
        parser.error("--profile needs py-spy: on the PATH, or its wheel in .gpu-bundle/debug/ "
                     "(scripts/gpu/bundle.sh fetches it; carry that folder in the device call)")
    from mmhandoff.models.dummy import ensure_dummy_model

    model = str(ensure_dummy_model(SHAPE))
    log_dir = Path(os.environ.get("OUT") or tempfile.mkdtemp(prefix="vs-vllm-"))
    t0 = time.monotonic()
    # the 12 MP JPEGs take a while to make: runs on one machine (arms in several calls) share
    name = f"vs-vllm-images-{len(CELLS)}-{'-'.join(map(str, profiled))}.json"
    cache = Path(tempfile.gettempdir()) / name
    if cache.exists():
        pool = json.loads(cache.read_text())
    else:
        pool = images(profiled)
        cache.write_text(json.dumps(pool))
    print(f"[vs_vllm] images ready in {time.monotonic() - t0:.0f} s; logs in {log_dir}",
          flush=True)
    profile = Path(args.profile) if args.profile else None
    # stopped from outside (a `timeout`): each arm's finally stops its servers, which run in
    # sessions of their own and would otherwise keep the GPU for whatever runs next
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    results = {arm: asyncio.run(run_arm(arm, model, pool, log_dir, profile, profiled, sizes))
               for arm in arms}
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))
    report(results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
