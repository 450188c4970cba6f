"""Time one engine's start for a model shape on the GPU host, to see where a slow start goes:

    WATCHDOG_S=150 scripts/gpu/device.sh run python3 scripts/gpu/engine_start.py qwen2.5-vl-7b prefill

prints the seconds to a ready engine (or the error); with WATCHDOG_S, device.sh writes every
process's Python stacks when the start is still going after that long."""

from __future__ import annotations

import asyncio
import json
import sys
import time


async def main(shape: str, role: str, extra: dict) -> None:
    from mmhandoff.models.dummy import ensure_dummy_model
    from mmhandoff.vllm_adapter import EngineSpec, start_engine

    t0 = time.perf_counter()
    spec = EngineSpec(model=str(ensure_dummy_model(shape)), role=role, dtype="bfloat16",
                      enforce_eager=True, extra={"load_format": "dummy", **extra},
                      gpu_memory_utilization=0.28, max_model_len=16384)
    engine = start_engine(spec)
    print(f"[engine_start] {shape} {role}: ready in {time.perf_counter() - t0:.1f} s", flush=True)
    engine.shutdown()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2], json.loads(sys.argv[3]) if len(sys.argv) > 3
                     else {}))
