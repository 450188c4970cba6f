"""Try the disagg graph across hosts on one machine (root): etcd and NATS, prefill, decode and
the frontend each in a network namespace of their own, KV over UCX TCP between them (the harness
of tests/test_multihost.py: tests/netns.py, tests/hosted_graph.py). Prints how to reach the
frontend, serves until Ctrl-C, then removes every namespace and process.

    sudo .venv/bin/python scripts/multihost.py [--graph disagg|disagg_router] [--files]
"""

from __future__ import annotations

import argparse
import signal
import sys
import tempfile
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main(argv=None) -> int:
    import yaml

    from tests.graph_runner import Servers
    from tests.hosted_graph import HostedGraph
    from tests.netns import Hosts

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--graph", choices=("disagg", "disagg_router"), default="disagg")
    p.add_argument("--files", action="store_true",
                   help="discovery through files and requests over TCP instead of etcd + NATS")
    args = p.parse_args(argv)
    config = yaml.safe_load((ROOT / "configs" / f"{args.graph}.yaml").read_text())
    placement = {"frontend": "front", "prefill": "prefill", "decode": "decode", "router": "front"}
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    with tempfile.TemporaryDirectory(prefix="mmhandoff-multihost-") as tmp, \
            Hosts(["infra", "prefill", "decode", "front"]) as hosts:
        servers = None
        if not args.files:  # images travel in requests: NATS' max_payload raised to its largest
            servers = Servers(Path(tmp), hosts, "infra", nats_max_payload=64 * 2**20)
            config.update(etcd=servers.etcd_url, nats=servers.nats_url)
        try:
            for name in hosts.names:
                print(f"host {name:8} {hosts.ip(name):12} namespace {hosts.ns(name)}")
            print("starting the graph (a minute or two) ...", flush=True)
            with HostedGraph(f"graphs.{args.graph}:Frontend", config, hosts, placement,
                             client="front") as graph:
                url = graph.frontend_url()
                print(f"ready: {url}/v1 (inside the hosts' network), e.g.\n"
                      f"  sudo ip netns exec {hosts.ns('front')} curl -s {url}/v1/models\n"
                      f"Ctrl-C stops it.", flush=True)
                stop.wait()
        finally:
            if servers:
                servers.close()
    print("stopped; namespaces removed")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
