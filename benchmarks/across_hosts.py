"""KV across hosts, on one machine: network namespaces joined by a bridge (tests/netns.py), each
with one veth, UCX over TCP only (no shared memory, no CMA between "hosts").

1. Pull: NIXL reads KV-shaped blocks (benchmarks/kv_pull_bandwidth.py's worker: shuffled block
   order, the initiator on host "decode", the owner on host "prefill") against a plain TCP socket
   copy of the same bytes over the same veth (one process per host: the reader asks, the owner
   sends the bytes into a preallocated buffer). Ratio NIXL / socket; target >= 0.5.
2. TTFT: the disagg graph (serve's supervisor) with prefill, decode and the frontend on three
   hosts, against the same graph on loopback, with UCX as one host has it (shared memory, CMA)
   and with UCX over TCP on loopback. Sequential streaming chat requests, a distinct 640x480 JPEG
   each; TTFT p50 (request sent to first token) and the answer's KV tokens pulled.

    sudo .venv/bin/python benchmarks/across_hosts.py [--parts pull,ttft] [--requests 16]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks import kv_pull_bandwidth as pull  # noqa: E402
from benchmarks.common import jpeg, pct  # noqa: E402
from tests.netns import DEVICE, UCX_TCP_TUNED, Hosts  # noqa: E402

SOCKET_PORT = 7300
RESULT = "RESULT "


# -- 1. the pull --------------------------------------------------------------------------------

def serve_bytes(address: str, nbytes: int) -> None:
    """Host "prefill": send `nbytes` for each request byte, until the reader hangs up."""
    payload = bytes(range(256)) * (nbytes // 256) + bytes(nbytes % 256)
    with socket.create_server((address, SOCKET_PORT)) as server:
        print("listening", flush=True)
        conn, _ = server.accept()
        with conn:
            while conn.recv(1):
                conn.sendall(payload)


def read_bytes(address: str, nbytes: int, repeats: int) -> None:
    """Host "decode": ask, then read `nbytes` into one buffer; each round timed."""
    buf = bytearray(nbytes)
    view = memoryview(buf)
    times = []
    with socket.create_connection((address, SOCKET_PORT)) as conn:
        for _ in range(repeats):
            t0 = time.perf_counter()
            conn.sendall(b"g")
            got = 0
            while got < nbytes:
                n = conn.recv_into(view[got:])
                if not n:
                    raise ConnectionError("the owner hung up")
                got += n
            times.append(time.perf_counter() - t0)
    correct = buf[:512] == bytes(range(256)) * 2
    print(RESULT + json.dumps({"seconds": times, "correct": correct}), flush=True)


def socket_copy(hosts, nbytes: int, repeats: int) -> dict:
    me = [sys.executable, __file__, "--bytes", str(nbytes), "--repeats", str(repeats)]
    owner = subprocess.Popen(hosts.command("prefill", [*me, "--serve-bytes",
                                                       hosts.ip("prefill")]),
                             stdout=subprocess.PIPE, text=True)
    try:
        assert owner.stdout.readline().strip() == "listening"
        reader = subprocess.run(hosts.command("decode", [*me, "--read-bytes",
                                                         hosts.ip("prefill")]),
                                capture_output=True, text=True, timeout=300)
    finally:
        owner.kill()
        owner.wait()
    line = next(ln for ln in reader.stdout.splitlines() if ln.startswith(RESULT))
    return json.loads(line[len(RESULT):])


def nixl_pull(hosts, args, ucx: dict) -> dict:
    saved = dict(os.environ)
    os.environ.update({pull.PEER_NETNS: hosts.ns("prefill"),
                       pull.INITIATOR_NETNS: hosts.ns("decode"),
                       "UCX_TLS": "tcp", "UCX_NET_DEVICES": DEVICE, "PYTHONPATH": str(ROOT),
                       **ucx})
    try:
        row = pull.run_arm("default", argparse.Namespace(
            device="cpu", blocks=args.blocks, block_bytes=args.block_bytes,
            repeats=args.repeats))
    finally:
        os.environ.clear()
        os.environ.update(saved)
    if "error" in row or not row["correct"]:
        raise SystemExit(json.dumps(row))
    return row


def part_pull(hosts, args) -> None:
    nbytes = args.blocks * args.block_bytes
    print(f"# pull: {args.blocks} blocks x {args.block_bytes} B = {nbytes / 2**20:.1f} MiB, "
          f"{args.repeats} transfers per arm (the first one's wire-up left out); NIXL with UCX's "
          f"TCP defaults and with {UCX_TCP_TUNED}", flush=True)
    for _ in range(args.rounds):
        plain, tuned = nixl_pull(hosts, args, {}), nixl_pull(hosts, args, UCX_TCP_TUNED)
        sock = socket_copy(hosts, nbytes, args.repeats)
        sock_gbps = pull._gbps(nbytes, sock["seconds"])
        assert sock["correct"]
        print(json.dumps({"socket_GBps": round(sock_gbps, 2),
                          "nixl_GBps": plain["nixl_GBps"], "nixl_tuned_GBps": tuned["nixl_GBps"],
                          "nixl_vs_socket": round(plain["nixl_GBps"] / sock_gbps, 3),
                          "nixl_tuned_vs_socket": round(tuned["nixl_GBps"] / sock_gbps, 3),
                          "transport": tuned["transport"]}), flush=True)


# -- 2. TTFT through the graph -----------------------------------------------------------------

def _ttft(url: str, images: list[bytes]) -> dict:
    import base64

    import openai

    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=300)
    ttft, pulled = [], []
    for image in images:
        uri = "data:image/jpeg;base64," + base64.b64encode(image).decode()
        t0 = time.perf_counter()
        first = None
        for chunk in client.chat.completions.create(
                model="tiny-llava", max_tokens=8, temperature=0, stream=True,
                stream_options={"include_usage": True},
                messages=[{"role": "user", "content": [
                    {"type": "image_url", "image_url": {"url": uri}},
                    {"type": "text", "text": "What is in it?"}]}]):
            if first is None and chunk.choices and chunk.choices[0].delta.content:
                first = time.perf_counter() - t0
            stats = (chunk.model_extra or {}).get("mmhandoff")
            if stats:
                pulled.append(stats.get("kv_tokens_pulled", -1))
        ttft.append(first)
    return {"ttft_ms": ttft[1:], "pulled": pulled}  # the first request warms the pull's wire-up


def _graph_config(ucx: dict) -> dict:
    import yaml

    config = yaml.safe_load((ROOT / "configs" / "disagg.yaml").read_text())
    config["env"].update(ucx)
    return config


def part_ttft(hosts, args) -> None:
    from mmhandoff.serve.supervisor import Supervisor, load_graph
    from tests.hosted_graph import HostedGraph

    images = [jpeg(640, 480, 500 + i) for i in range(args.requests + 1)]
    placement = {"frontend": "front", "prefill": "prefill", "decode": "decode"}
    arms = {
        "across hosts (UCX tcp/eth0)": lambda: HostedGraph(
            "graphs.disagg:Frontend", _graph_config({}), hosts, placement, client="front"),
        "loopback (UCX as one host)": lambda: Supervisor(
            load_graph("graphs.disagg:Frontend"), _graph_config({"UCX_NET_DEVICES": "lo"}), None),
        "loopback (UCX tcp/lo)": lambda: Supervisor(
            load_graph("graphs.disagg:Frontend"),
            _graph_config({"UCX_NET_DEVICES": "lo", "UCX_TLS": "tcp"}), None),
    }
    print(f"# ttft: disagg graph, {args.requests} sequential streaming requests, a distinct "
          f"640x480 JPEG each, 8 tokens", flush=True)
    rows = {}
    for name, make in arms.items():
        graph = make()
        hosted = isinstance(graph, HostedGraph)
        if hosted:
            graph.__enter__()
        else:
            graph.start()
            if not graph.wait_ready(lambda: False, 400):
                graph.stop()
                raise SystemExit(f"{name}: graph not ready")
        try:
            url = graph.frontend_url()
            got = hosts.call("front", _ttft, url, images) if hosted else _ttft(url, images)
        finally:
            graph.stop()
        ms = [t * 1e3 for t in got["ttft_ms"]]
        rows[name] = statistics.median(ms)
        print(json.dumps({"arm": name, "ttft_p50_ms": round(statistics.median(ms), 1),
                          "ttft_p95_ms": round(pct(ms, 95), 1),
                          "kv_tokens_pulled": sorted(set(got["pulled"]))}), flush=True)
    across, local = rows["across hosts (UCX tcp/eth0)"], rows["loopback (UCX as one host)"]
    print(json.dumps({"across_vs_loopback_ttft": round(across / local, 3),
                      "across_vs_loopback_tcp_ttft": round(
                          across / rows["loopback (UCX tcp/lo)"], 3)}), flush=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--parts", default="pull,ttft")
    p.add_argument("--blocks", type=int, default=608, help="default: 16 handoffs of 38 blocks")
    p.add_argument("--block-bytes", type=int, default=128 * 1024)
    p.add_argument("--repeats", type=int, default=6)
    p.add_argument("--rounds", type=int, default=3, help="pull: NIXL and socket, side by side")
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--bytes", type=int, help=argparse.SUPPRESS)
    p.add_argument("--serve-bytes", help=argparse.SUPPRESS)
    p.add_argument("--read-bytes", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.serve_bytes:
        serve_bytes(args.serve_bytes, args.bytes)
        return 0
    if args.read_bytes:
        read_bytes(args.read_bytes, args.bytes, args.repeats)
        return 0
    with Hosts(["prefill", "decode", "front"]) as hosts:
        parts = args.parts.split(",")
        if "pull" in parts:
            part_pull(hosts, args)
        if "ttft" in parts:
            part_ttft(hosts, args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
