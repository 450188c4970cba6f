"""The `mmhandoff` command."""

from __future__ import annotations

import argparse
import sys

from mmhandoff.models.tiny import ARCHES


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="mmhandoff", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    make = sub.add_parser("make-tiny-model", help="build (or find) the tiny random-weight VLM")
    make.add_argument("dir", nargs="?", help="target folder (default: the cache folder)")
    make.add_argument("--arch", default="llava", choices=ARCHES,
                      help="llava: LLaVA-1.5 layout (default); qwen2_vl, qwen2_5_vl, qwen3_vl: "
                      "M-RoPE positions")
    srv = sub.add_parser("serve", help="run a graph on this host: graphs.<graph>:<Component>")
    srv.add_argument("target", help="e.g. graphs.disagg:Frontend")
    srv.add_argument("-f", "--config", required=True, help="the graph's YAML, e.g. configs/disagg.yaml")
    srv.add_argument("--port", type=int, help="frontend port (overrides the YAML)")
    args = parser.parse_args(argv)

    if args.command == "serve":
        from mmhandoff import logs
        from mmhandoff.serve.supervisor import GraphError, serve

        logs.setup(sys.stdout)  # serve's lines are its output; its components' come through it

        try:
            return serve(args.target, args.config, args.port)
        except GraphError as e:
            print(f"mmhandoff serve: {e}", file=sys.stderr)
            return 2

    if args.command == "make-tiny-model":
        from mmhandoff.models.build import tree_digest
        from mmhandoff.models.tiny import ensure_tiny_model

        path = ensure_tiny_model(args.dir, arch=args.arch)
        print(f"{path}  sha256:{tree_digest(path)[:16]}")
        return 0
    return 2


if __name__ == "__main__":
    sys.exit(main())
