"""A follow-up turn with prefill's bypass vs through prefill, side by side in one run.

    .venv/bin/python benchmarks/follow_up_bypass.py [--conversations 8] [--size 640x480]

Each conversation: its first turn (an image and a question) goes through prefill and decode,
which leaves the turn's blocks in decode's prefix cache (and prefill's). Then three follow-ups
of it, one per arm, each with its own closing question (rotated over the arms, so each arm
meets decode in the state the first turn left):
- through prefill: prefill's cache still holds the first turn (the default path; the answer's
  first token is prefill's);
- through prefill, cache cold: prefill's prefix cache reset first (another prefill replica took
  it, or it was evicted): prefill runs the vision encoder and the whole prompt again;
- bypass: prefill renders, the router's lookup (its index, fed here with the first turn's
  blocks, and the engines' own hashes) finds decode holds the image, decode computes the rest.
TTFT: the request's start to the answer's first token (prefill's, or decode's when bypassed).
Every follow-up repeats the first turn's data URI, so none decodes the image again
(engine.prompt's memo).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("UCX_NET_DEVICES", "lo")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

from benchmarks.common import jpeg, pct, port  # noqa: E402

ARMS = ("through prefill", "through prefill, cache cold", "bypass")
CLOSINGS = ("Tell me more.", "What else is there?", "And the colours?")
QUESTION = ("Look at this picture carefully and describe what you see in it, the colours, the "
            "shapes, and anything else that stands out.")


class IndexLookup:
    """router.held in process: the router's own Router.held over an index holding what decode
    holds (the first turns' prompt blocks), without the network hop."""

    def __init__(self, router) -> None:
        self.router = router

    async def held(self, handoff):
        import msgspec

        return self.router.held(msgspec.to_builtins(handoff))


async def main(args) -> None:
    engines: dict = {}
    try:
        await measure(args, engines)
    finally:  # a failed run too: no engine left running, no IPC files left behind
        for engine in engines.values():
            engine.shutdown()
        engines.clear()


async def measure(args, engines: dict) -> None:
    import msgspec

    from mmhandoff.decode.worker import DecodeWorker
    from mmhandoff.models.tiny import ensure_tiny_model
    from mmhandoff.prefill.worker import PrefillWorker
    from mmhandoff.router.router import Router
    from mmhandoff.vllm_adapter import EngineSpec, start_engine
    from mmhandoff.vllm_adapter.block_hashes import BlockHasher
    from mmhandoff.wire.handoff import Sampling
    from mmhandoff.wire.messages import ChatMessage, PrefillRequest, user

    common = dict(model=str(ensure_tiny_model()), dtype="float32")
    for role, core in (("prefill", "0"), ("decode", "1")):
        print(f"[bench] starting the {role} engine ...", file=sys.stderr, flush=True)
        engines[role] = start_engine(EngineSpec(role=role, cpu_cores=core, nixl_port=port(),
                                                **common))

    class OneDecode:
        def instance_ids(self):
            return [1]

    router = Router(OneDecode(), hasher=BlockHasher(engines["decode"].block_size))
    plain = PrefillWorker(engines["prefill"])
    bypassing = PrefillWorker(engines["prefill"], router=IndexLookup(router),
                              bypass_max_tokens=args.bypass_max_tokens)
    bypassing.prompts = plain.prompts  # one prefill worker, as deployed: one memo of decodes
    decode = DecodeWorker(engines["decode"], kv_deadline_s=60)
    sampling = Sampling(max_tokens=args.tokens, temperature=0.0, ignore_eos=True)
    width, height = (int(x) for x in args.size.split("x"))

    async def answer(worker, request) -> tuple[float, bool]:
        """TTFT in ms (the whole answer is read), and whether it was bypassed."""
        t0 = time.perf_counter()
        prefilled = await worker.prefill(request)
        ttft = (time.perf_counter() - t0) * 1e3 if prefilled.first is not None else None
        async for _ in decode.generate(prefilled.handoff):
            if ttft is None:
                ttft = (time.perf_counter() - t0) * 1e3
        return ttft, prefilled.stats.bypassed

    ttfts: dict[str, list[float]] = {arm: [] for arm in ARMS}
    for c in range(args.conversations + 1):  # conversation 0 warms every path up
        uri = "data:image/jpeg;base64," + base64.b64encode(jpeg(width, height, 700 + c)).decode()
        first = [user(QUESTION, uri)]
        prefilled = await plain.prefill(PrefillRequest(request_id=f"c{c}", messages=first,
                                                       sampling=sampling))
        turn = prefilled.handoff
        async for _ in decode.generate(turn):
            pass
        router.decode.index.stored(1, router.hasher.of_handoff(turn))  # what decode's events say
        for n, arm in enumerate(ARMS):
            closing = CLOSINGS[(n + c) % len(CLOSINGS)]
            messages = [*first, ChatMessage("assistant", "A picture."),
                        ChatMessage("user", closing)]
            request = PrefillRequest(request_id=f"c{c}-{n}", messages=messages, sampling=sampling)
            if arm == "through prefill, cache cold":
                assert await engines["prefill"].llm.reset_prefix_cache(), "prefill's cache busy"
            ttft, bypassed = await answer(bypassing if arm == "bypass" else plain, request)
            assert bypassed == (arm == "bypass"), (arm, msgspec.to_builtins(request)["messages"])
            if c:
                ttfts[arm].append(ttft)
                if args.verbose:
                    print(f"[bench] {arm}: {ttft:.1f} ms", file=sys.stderr, flush=True)

    print(f"\n## Follow-up turn: bypass vs through prefill (tiny model, {args.size} JPEG, "
          f"{args.conversations} conversations, {args.tokens} output tokens)\n")
    print("| arm | TTFT p50 ms | TTFT p95 ms |")
    print("|---|---|---|")
    for arm in ARMS:
        print(f"| {arm} | {pct(ttfts[arm], 50):.1f} | {pct(ttfts[arm], 95):.1f} |")
    by = statistics.median(ttfts["bypass"])
    print(f"\nbypass / through prefill, TTFT p50: {by / statistics.median(ttfts[ARMS[0]]):.2f}; "
          f"bypass / through a cold prefill: {by / statistics.median(ttfts[ARMS[1]]):.2f}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--conversations", type=int, default=8)
    parser.add_argument("--size", default="640x480", help="image size, WIDTHxHEIGHT")
    parser.add_argument("--tokens", type=int, default=8, help="output tokens per answer")
    parser.add_argument("--bypass-max-tokens", type=int, default=256)
    parser.add_argument("--verbose", action="store_true")
    asyncio.run(main(parser.parse_args()))
    # The engines are shut down and the results printed. Ending here skips the interpreter's
    # teardown, in which AsyncLLM.__del__ shuts each engine down again (handoff_vs_full_media).
    sys.stdout.flush()
    os._exit(0)
