"""How fast NIXL pulls KV-shaped blocks from another process, against a plain copy of the same
blocks, and which transport UCX chose for it. Runs on CPU (DRAM) and on a GPU (VRAM).

The shape is a handoff's: `--blocks` descriptors of `--block-bytes` each (the defaults are a
593-token LLaVA-1.5-7B prompt: 38 KV blocks of 16 tokens x 32 layers x K and V, 128 KiB each),
read by an initiator process from a target process in a shuffled order (vLLM's blocks are not
contiguous, so NIXL cannot merge them). Each arm is a fresh pair of processes with its own UCX
settings; UCX's protocol report (`UCX_PROTO_INFO=y`) says which transport served the read.

Arms (`--arms`, comma-separated):
- `default`: UCX as installed.
- `ipc_get`: `UCX_CUDA_IPC_ENABLE_GET_ZCOPY=y`. UCX turns cuda_ipc's GET off when it detects no
  active NVLink (uct cuda_ipc_iface.c); a NIXL READ (vLLM's NixlConnector pulls) then falls back
  to "software emulation" over TCP. This turns it back on.
- `write`: the same blocks pushed by the target with a NIXL WRITE (cuda_ipc's PUT is never off).

Baselines, in the initiator, over the same blocks: `copy_local` (one gather of the blocks between
two of its own buffers) and, on a GPU, `copy_ipc` (the same gather reading the target's buffer
through a CUDA IPC mapping: the path cuda_ipc uses).

    python benchmarks/kv_pull_bandwidth.py --device cuda --arms default,ipc_get,write
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time

ARMS = {
    "default": ({}, "READ"),
    "ipc_get": ({"UCX_CUDA_IPC_ENABLE_GET_ZCOPY": "y"}, "READ"),
    "write": ({}, "WRITE"),
}
RESULT = "RESULT "
PEER_NETNS, INITIATOR_NETNS = "MMHANDOFF_PEER_NETNS", "MMHANDOFF_INITIATOR_NETNS"


def _pattern(nbytes: int, device: str):
    import torch

    g = torch.Generator(device=device)
    g.manual_seed(1234)
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=device, generator=g)


def _descs(base: int, order, block_bytes: int, device_id: int):
    import numpy as np

    d = np.zeros((len(order), 3), dtype=np.uint64)
    d[:, 0] = base + np.asarray(order, dtype=np.uint64) * block_bytes
    d[:, 1] = block_bytes
    d[:, 2] = device_id
    return d


def _wait(agent, handle, timeout_s: float = 60.0) -> None:
    state, t0 = agent.transfer(handle), time.monotonic()
    while state == "PROC":
        if time.monotonic() - t0 > timeout_s:
            raise TimeoutError(f"transfer still in progress after {timeout_s} s")
        state = agent.check_xfer_state(handle)
    if state != "DONE":
        raise RuntimeError(f"transfer ended in state {state}")


def _in_netns(var: str) -> None:
    """Across "hosts" (benchmarks/across_hosts.py): this process into the network namespace
    named by $var, before UCX starts a thread or opens a socket."""
    if os.environ.get(var):
        from tests.netns import enter

        enter(os.environ[var])


def _peer(conn, device: str, nbytes: int, op: str, blocks: int, block_bytes: int) -> None:
    """The other process: owns the source buffer (READ) or pushes into the initiator's (WRITE)."""
    _in_netns(PEER_NETNS)
    import torch
    from nixl._api import nixl_agent, nixl_agent_config

    src = _pattern(nbytes, device)
    agent = nixl_agent("peer", nixl_agent_config(backends=["UCX"]))
    agent.register_memory(src)
    conn.send((agent.get_agent_metadata(), src.data_ptr(), src if device == "cuda" else None))
    if op == "WRITE":
        remote = agent.add_remote_agent(conn.recv())
        dst_base, order, repeats = conn.recv()
        mem, dev = ("VRAM", src.get_device()) if device == "cuda" else ("DRAM", 0)
        local_h = agent.prep_xfer_dlist("NIXL_INIT_AGENT", _descs(src.data_ptr(), order,
                                                                  block_bytes, dev), mem)
        remote_h = agent.prep_xfer_dlist(remote, _descs(dst_base, range(blocks), block_bytes,
                                                        dev), mem)
        times = []
        for _ in range(repeats):
            h = agent.make_prepped_xfer("WRITE", local_h, list(range(blocks)), remote_h,
                                        list(range(blocks)))
            t0 = time.perf_counter()
            _wait(agent, h)
            times.append(time.perf_counter() - t0)
            h.release()
        conn.send(times)
    conn.recv()  # the initiator is done with our memory
    del torch


def _timed_copy(fn, device: str, repeats: int) -> list[float]:
    import torch

    times = []
    for _ in range(repeats):
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return times


def worker(args) -> None:
    _in_netns(INITIATOR_NETNS)
    import numpy as np
    import torch
    import torch.multiprocessing as mp
    from nixl._api import nixl_agent, nixl_agent_config

    nbytes = args.blocks * args.block_bytes
    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    peer = ctx.Process(target=_peer, args=(child, args.device, nbytes, args.op, args.blocks,
                                           args.block_bytes))
    peer.start()
    meta, src_base, src_ipc = conn.recv()
    order = np.random.default_rng(0).permutation(args.blocks).tolist()
    dst = torch.zeros(nbytes, dtype=torch.uint8, device=args.device)
    agent = nixl_agent("initiator", nixl_agent_config(backends=["UCX"]))
    agent.register_memory(dst)
    mem, dev = ("VRAM", dst.get_device()) if args.device == "cuda" else ("DRAM", 0)
    times: list[float]
    if args.op == "READ":
        remote = agent.add_remote_agent(meta)
        local_h = agent.prep_xfer_dlist("NIXL_INIT_AGENT", _descs(dst.data_ptr(),
                                        range(args.blocks), args.block_bytes, dev), mem)
        remote_h = agent.prep_xfer_dlist(remote, _descs(src_base, order, args.block_bytes, dev),
                                         mem)
        times = []
        for _ in range(args.repeats):
            idx = list(range(args.blocks))
            h = agent.make_prepped_xfer("READ", local_h, idx, remote_h, idx)
            t0 = time.perf_counter()
            _wait(agent, h)
            times.append(time.perf_counter() - t0)
            h.release()
    else:
        conn.send(agent.get_agent_metadata())
        conn.send((dst.data_ptr(), order, args.repeats))
        times = conn.recv()
    # Every block must hold what the peer's block at its place in `order` holds.
    expected = _pattern(nbytes, args.device).view(args.blocks, args.block_bytes)
    perm = torch.tensor(order, device=args.device)
    correct = bool(torch.equal(dst.view(args.blocks, args.block_bytes), expected[perm]))
    rows = args.blocks
    local_src = expected.clone()
    out = dst.view(rows, args.block_bytes)
    baselines = {"copy_local": _timed_copy(
        lambda: torch.index_select(local_src, 0, perm, out=out), args.device, args.repeats)}
    if src_ipc is not None:
        peer_rows = src_ipc.view(rows, args.block_bytes)
        baselines["copy_ipc"] = _timed_copy(
            lambda: torch.index_select(peer_rows, 0, perm, out=out), args.device, args.repeats)
    conn.send("done")
    peer.join(timeout=30)
    print(RESULT + json.dumps({"bytes": nbytes, "nixl_s": times, "correct": correct,
                               **{k: v for k, v in baselines.items()}}), flush=True)


def _gbps(nbytes: int, seconds: list[float]) -> float:
    warm = seconds[1:] or seconds  # the first transfer includes the connection's wire-up
    return nbytes / statistics.median(warm) / 1e9


def _transport(log: str, op: str) -> str:
    """UCX's own line for the remote-memory protocol that served `op` (from UCX_PROTO_INFO)."""
    # A table per protocol: "| <peer> cfg#N |", "| remote memory read by ... |", a header row,
    # then rows "| range | description | transport/device |".
    word = "read" if op == "READ" else "write"
    picked, peer, title = [], "", ""
    for ln in log.splitlines():
        cells = [c.strip() for c in ln.partition("|")[2].split("|") if c.strip()]
        if len(cells) == 1:
            if "cfg#" in cells[0]:
                peer, title = cells[0], ""
            else:
                title = cells[0]
        elif (len(cells) == 3 and f"remote memory {word}" in title and cells[0] != "Range"
              and " self cfg#" not in peer):  # a worker's loopback to itself
            picked.append(re.sub(r"\s+", " ", f"{cells[0]} {cells[1]} {cells[2]}"))
    return "; ".join(dict.fromkeys(picked)) or "(UCX reported no protocol line)"


def run_arm(name: str, args) -> dict:
    env_extra, op = ARMS[name]
    env = dict(os.environ, UCX_PROTO_INFO="y", UCX_LOG_LEVEL="info", **env_extra)
    cmd = [sys.executable, __file__, "--worker", "--op", op, "--device", args.device,
           "--blocks", str(args.blocks), "--block-bytes", str(args.block_bytes),
           "--repeats", str(args.repeats)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    log = proc.stdout + proc.stderr
    result = next((json.loads(ln[len(RESULT):]) for ln in proc.stdout.splitlines()
                   if ln.startswith(RESULT)), None)
    if proc.returncode != 0 or result is None:
        return {"arm": name, "error": f"exit {proc.returncode}: {log[-2000:]}"}
    n = result["bytes"]
    row = {"arm": name, "op": op, "correct": result["correct"],
           "nixl_GBps": round(_gbps(n, result["nixl_s"]), 2),
           "first_ms": round(result["nixl_s"][0] * 1e3, 2),
           "warm_ms": round(statistics.median(result["nixl_s"][1:] or result["nixl_s"]) * 1e3, 3),
           "transport": _transport(log, op)}
    for k in ("copy_local", "copy_ipc"):
        if k in result:
            row[f"{k}_GBps"] = round(_gbps(n, result[k]), 2)
    base = row.get("copy_ipc_GBps") or row["copy_local_GBps"]
    row["nixl_vs_copy"] = round(row["nixl_GBps"] / base, 3)
    return row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--blocks", type=int, default=2432)
    p.add_argument("--block-bytes", type=int, default=128 * 1024)
    p.add_argument("--repeats", type=int, default=6)
    p.add_argument("--arms", default="default,ipc_get,write")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--op", default="READ", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    names = [a for a in args.arms.split(",") if a]
    unknown = set(names) - set(ARMS)
    if unknown:
        p.error(f"unknown arms {sorted(unknown)}; known: {sorted(ARMS)}")
    mib = args.blocks * args.block_bytes / 2**20
    print(f"# {args.blocks} blocks x {args.block_bytes} B = {mib:.0f} MiB, {args.device}, "
          f"{args.repeats} transfers per arm (the first includes wire-up)", flush=True)
    failed = False
    for name in names:
        row = run_arm(name, args)
        print(json.dumps(row), flush=True)
        failed |= "error" in row or not row.get("correct")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
