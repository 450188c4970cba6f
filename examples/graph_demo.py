"""The main job: start the disagg graph, ask it about a picture, print the answer and the
handoff statistics, stop the graph.

    .venv/bin/python examples/graph_demo.py [--image PATH] [--max-tokens N]

Runs `mmhandoff serve graphs.disagg:Frontend -f configs/disagg.yaml` (frontend, prefill worker,
decode worker; tiny model; file discovery, no etcd or NATS), sends one chat request with an image
through the official openai client, and stops the graph with SIGTERM. The full graph log is kept
in a temporary file, named at the end.
"""

from __future__ import annotations

import argparse
import base64
import io
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def sample_image() -> bytes:
    import numpy as np
    from PIL import Image

    y, x = np.mgrid[0:480, 0:640]
    rgb = np.stack([x * 255 // 640, y * 255 // 480, (x + y) * 255 // 1120], -1).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(rgb).save(buf, format="JPEG", quality=90)
    return buf.getvalue()


def free_port() -> int:
    from mmhandoff.plane.ports import free_port as take  # not from the ephemeral range

    return take()


def start_graph(port: int, log_path: Path) -> subprocess.Popen:
    """Start serve; echo its own progress lines, keep everything in the log file."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "mmhandoff", "serve", "graphs.disagg:Frontend", "-f",
         str(ROOT / "configs/disagg.yaml"), "--port", str(port)],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    ready = threading.Event()

    def relay():
        with open(log_path, "w") as log:
            for line in proc.stdout:
                log.write(line)
                log.flush()
                if line.startswith("[serve]"):
                    print(line, end="", file=sys.stderr, flush=True)
                if line.startswith("[serve] ready"):
                    ready.set()
        ready.set()

    threading.Thread(target=relay, daemon=True).start()
    ready.wait(900)
    if proc.poll() is not None:
        raise SystemExit(f"the graph exited with {proc.returncode}; log: {log_path}")
    return proc


def main() -> int:
    import openai

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--image", type=Path, help="an image file (default: a generated JPEG)")
    parser.add_argument("--max-tokens", type=int, default=16)
    args = parser.parse_args()
    image = args.image.read_bytes() if args.image else sample_image()
    mime = "image/png" if image.startswith(b"\x89PNG") else "image/jpeg"

    port, log_path = free_port(), Path(tempfile.mkdtemp(prefix="mmhandoff-demo-")) / "graph.log"
    graph = start_graph(port, log_path)
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none",
                               max_retries=0, timeout=300)
        reply = client.chat.completions.create(
            model="tiny-llava", max_tokens=args.max_tokens, temperature=0, messages=[
                {"role": "user", "content": [
                    {"type": "image_url", "image_url": {
                        "url": f"data:{mime};base64,{base64.b64encode(image).decode()}"}},
                    {"type": "text", "text": "What is in this picture?"}]}])
        s = reply.model_extra["mmhandoff"]
        p = s.get("prefill", {})
        print(f"answer ({reply.usage.completion_tokens} tokens, random weights): "
              f"{reply.choices[0].message.content!r}")
        print(f"image: {len(image)} bytes; prompt: {reply.usage.prompt_tokens} tokens")
        print(f"prefill: image + prompt preparation {p.get('prepare_ms', 0):.1f} ms, "
              f"prefill {p.get('prefill_ms', 0):.1f} ms")
        if s["request_bytes"] < 0:  # the first token (prefill's) ended the answer
            print("the answer ended at prefill's first token: nothing went to decode")
        else:
            print(f"handoff sent to decode: {s['request_bytes']} bytes (no media)")
            print(f"decode-side preparation: {s['prepare_ms']:.2f} ms; decode's first token "
                  f"(the answer's second: the first is prefill's) after {s['ttft_ms']:.1f} ms "
                  f"(KV pull included)")
            print(f"KV tokens pulled over NIXL: {s['kv_tokens_pulled']}; from decode's own "
                  f"cache: {s['kv_tokens_local']}")
    finally:
        graph.send_signal(signal.SIGTERM)
        code = graph.wait(timeout=120)
        print(f"[demo] graph stopped (exit {code}); its log: {log_path}", file=sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(main())
