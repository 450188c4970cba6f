"""Run one image request through the handoff once and print the answer and its statistics.

    .venv/bin/python examples/handoff_once.py [--image PATH] [--max-tokens N]

Starts a prefill engine (whole VLM, NIXL producer) and a decode engine (no vision tower, NIXL
consumer, fail-closed scheduler) on the tiny model, one CPU core each; sends a chat request with
an image to prefill, which samples the answer's first token; hands the decode engine only the
metadata and that token; prints the answer (prefill's token, then decode's).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("UCX_NET_DEVICES", "lo")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # keep the answer readable

from examples.graph_demo import free_port as _port  # noqa: E402
from examples.graph_demo import sample_image as _sample_image  # noqa: E402


def step(msg: str) -> None:
    print(f"[demo] {msg}", file=sys.stderr, flush=True)


async def run(image: bytes, max_tokens: int) -> None:
    from mmhandoff.decode.worker import DecodeWorker
    from mmhandoff.models.tiny import ensure_tiny_model
    from mmhandoff.prefill.worker import PrefillWorker
    from mmhandoff.vllm_adapter import EngineSpec, start_engine
    from mmhandoff.wire.handoff import Sampling, encode_handoff
    from mmhandoff.wire.messages import PrefillRequest, user

    model = str(ensure_tiny_model())
    t = time.perf_counter()
    step("starting the prefill engine (core 0) ...")
    prefill = start_engine(EngineSpec(model=model, role="prefill", cpu_cores="0",
                                      nixl_port=_port(), dtype="float32"))
    step("starting the decode engine (core 1) ...")
    decode = start_engine(EngineSpec(model=model, role="decode", cpu_cores="1",
                                     nixl_port=_port(), dtype="float32"))
    step(f"engines ready in {time.perf_counter() - t:.0f} s")
    try:
        uri = "data:image/jpeg;base64," + base64.b64encode(image).decode()
        request = PrefillRequest(
            request_id="demo-1",
            messages=[user("What is in this picture?", uri)],
            sampling=Sampling(max_tokens=max_tokens, temperature=0.0))
        answer = await PrefillWorker(prefill).prefill(request)
        handoff, pstats = answer.handoff, answer.stats
        # the answer's first token is prefill's; decode continues after it
        tokens, text = [answer.first.token_id], answer.first.text
        if handoff is None:
            print(f"answer (ended at prefill's token, {answer.first.finish_reason}): {text!r}")
            return
        async for chunk in DecodeWorker(decode).generate(encode_handoff(handoff)):
            tokens, text, s = tokens + chunk.token_ids, text + chunk.text, chunk.stats
        print(f"answer ({len(tokens)} tokens, random weights): {text!r}")
        print(f"image: {len(image)} bytes; prompt: {len(handoff.token_ids)} tokens, "
              f"image span {handoff.features.mm_placeholders['image'][0].offset}"
              f"+{handoff.features.mm_placeholders['image'][0].length}")
        print(f"prefill: prepare {pstats.prepare_ms:.1f} ms, prefill {pstats.prefill_ms:.1f} ms")
        print(f"handoff sent to decode: {s.request_bytes} bytes (no media)")
        print(f"decode-side preparation: {s.prepare_ms:.2f} ms; time to its first token (the "
              f"answer's second): {s.ttft_ms:.1f} ms")
        print(f"KV tokens pulled over NIXL: {s.kv_tokens_pulled}; from decode's own cache: "
              f"{s.kv_tokens_local}")
    finally:
        prefill.shutdown()
        decode.shutdown()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--image", type=Path, help="an image file (default: a generated JPEG)")
    parser.add_argument("--max-tokens", type=int, default=16)
    args = parser.parse_args()
    image = args.image.read_bytes() if args.image else _sample_image()
    asyncio.run(run(image, args.max_tokens))
    return 0


if __name__ == "__main__":
    sys.exit(main())
