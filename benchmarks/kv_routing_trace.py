"""A multi-turn trace with repeated images through disagg_router (two prefill, two decode
replicas), once per router policy, side by side in one run: how much of each repeated image's
KV the chosen prefill and decode replicas already held (each engine's own count), and how much
KV decode pulled from prefill (tokens, and bytes at the model's KV size per token); against the
oracle, which serves every repeat where its blocks are (100% found, and pulls only what no
replica holds).

    .venv/bin/python benchmarks/kv_routing_trace.py [--policies kv,round_robin,random]

The trace (`trace`, which tests/test_kv_routing.py uses too): 12 two-turn conversations about 6
images (64x48 PNG), seeded interleaving, one request at a time, 8 output tokens each
(ignore_eos), temperature 0.
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.common import port  # noqa: E402

MODEL = "tiny-llava"
IMAGES, CONVERSATIONS, TURNS = 6, 12, 2  # conversation c is about image c % IMAGES
SIZE, BLOCK = (64, 48), 32


def trace(seed: int) -> list[tuple[int, int]]:
    """(conversation, turn) in a seeded interleaving; each conversation's turns in order."""
    rng = random.Random(seed)
    left = {c: 0 for c in range(CONVERSATIONS)}
    order = []
    while left:
        c = rng.choice(sorted(left))
        order.append((c, left[c]))
        left[c] += 1
        if left[c] == TURNS:
            del left[c]
    return order


def next_turn(history: dict[int, list], c: int, turn: int, uris: list[str]) -> list:
    """Conversation c's messages for `turn`: its image and a question first, then a follow-up
    after the answers so far (the caller appends each answer to `history[c]`)."""
    if turn == 0:
        history[c] = [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": uris[c % IMAGES]}},
            {"type": "text", "text": f"Question {c}?"}]}]
    else:
        history[c].append({"role": "user", "content": "Tell me more."})
    return history[c]


def image_uri(seed: int) -> str:
    import numpy as np
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (SIZE[1], SIZE[0], 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def model_facts(model: str) -> tuple[int, int]:
    """(cacheable tokens through the image: full blocks up to its end, KV bytes per token in
    bf16), from the model's own processor and config, not from mmhandoff."""
    from PIL import Image
    from transformers import AutoProcessor

    proc = AutoProcessor.from_pretrained(model)
    text = proc.apply_chat_template([{"role": "user", "content": [
        {"type": "image"}, {"type": "text", "text": "Question 0?"}]}], add_generation_prompt=True)
    ids = list(proc(text=text, images=[Image.new("RGB", SIZE)])["input_ids"][0])
    image_id = proc.tokenizer.convert_tokens_to_ids("<image>")
    end = max(i for i, t in enumerate(ids) if t == image_id) + 1
    config = json.loads((Path(model) / "config.json").read_text())
    text_config = config.get("text_config", config)
    heads = text_config["num_attention_heads"]
    head_dim = text_config.get("head_dim") or text_config["hidden_size"] // heads
    kv_heads = text_config.get("num_key_value_heads", heads)
    per_token = 2 * text_config["num_hidden_layers"] * kv_heads * head_dim * 2  # K and V, bf16
    return end // BLOCK * BLOCK, per_token


def ask(url: str, messages: list) -> dict:
    body = json.dumps({"model": MODEL, "messages": messages, "max_tokens": 8, "temperature": 0,
                       "ignore_eos": True}).encode()
    req = urllib.request.Request(url + "/v1/chat/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())


def run_policy(policy: str, tmp: Path, order, uris) -> list[tuple[int, dict]]:
    """(trace position, the answer's mmhandoff stats) for every request, in trace order."""
    spec = yaml.safe_load((ROOT / "configs" / "disagg_router.yaml").read_text())
    args = spec["components"]["router"]["args"]
    args[args.index("--policy") + 1] = policy
    # prefill's bypass off: every request meets both tiers, whose routing is what is measured
    args = spec["components"]["prefill"]["args"]
    args[args.index("--bypass-max-tokens") + 1] = "0"
    config = tmp / f"{policy}.yaml"
    config.write_text(yaml.safe_dump(spec))
    p = port()
    url = f"http://127.0.0.1:{p}"
    env = dict(os.environ, UCX_NET_DEVICES="lo", DYN_LOG="warn", VLLM_LOGGING_LEVEL="WARNING")
    with open(tmp / f"{policy}.log", "w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "mmhandoff", "serve", "graphs.disagg_router:Frontend", "-f",
             str(config), "--port", str(p)], env=env, stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True)
        try:
            deadline = time.monotonic() + 600
            while True:
                if proc.poll() is not None:
                    raise SystemExit(f"{policy}: serve exited ({tmp / f'{policy}.log'})")
                try:
                    with urllib.request.urlopen(url + "/v1/models", timeout=2):
                        break
                except OSError:
                    if time.monotonic() > deadline:
                        raise SystemExit(f"{policy}: not ready in 600 s") from None
                    time.sleep(0.5)
            history: dict[int, list] = {}
            out = []
            for n, (c, turn) in enumerate(order):
                r = ask(url, next_turn(history, c, turn, uris))
                history[c].append({"role": "assistant",
                                   "content": r["choices"][0]["message"]["content"]})
                out.append((n, r["mmhandoff"]))
            return out
        finally:
            os.killpg(proc.pid, signal.SIGINT)
            try:
                proc.wait(120)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--policies", default="kv,round_robin,random")
    p.add_argument("--seed", type=int, default=13)
    args = p.parse_args(argv)
    from mmhandoff.models.tiny import ensure_tiny_model

    model = str(ensure_tiny_model())
    cacheable, kv_bytes = model_facts(model)
    order = trace(args.seed)
    uris = [image_uri(500 + i) for i in range(IMAGES)]
    seen, repeats = set(), []
    for n, (c, _) in enumerate(order):
        if c % IMAGES in seen:
            repeats.append(n)
        seen.add(c % IMAGES)
    print(f"# {len(order)} requests, {len(repeats)} about an image seen before; {cacheable} "
          f"cacheable tokens through each image; {kv_bytes} bytes of KV per token (bf16)")
    print("| policy | found on prefill | found on decode | decode vs oracle | KV pulled: tokens "
          "| MiB | vs kv |")
    print("|---|---|---|---|---|---|---|")
    rows = {}
    with tempfile.TemporaryDirectory(prefix="mmhandoff-kvtrace-") as tmp:
        for policy in args.policies.split(","):
            stats = dict(run_policy(policy, Path(tmp), order, uris))

            def found(key):
                return sum(min(key(stats[n]), cacheable) for n in repeats) / (
                    cacheable * len(repeats))

            prefill = found(lambda s: s["prefill"]["cached_tokens"])
            decode = found(lambda s: s["kv_tokens_local"])
            pulled = sum(s["kv_tokens_pulled"] for s in stats.values())
            rows[policy] = pulled
            vs = f"{pulled / rows['kv']:.2f}x" if rows.get("kv") else "-"
            print(f"| {policy} | {prefill:.0%} | {decode:.0%} | {decode:.2f}x | {pulled} | "
                  f"{pulled * kv_bytes / 2**20:.2f} | {vs} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
