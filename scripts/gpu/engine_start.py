"""Time one engine's start for a model shape on the GPU host, to see where a slow start goes:

    WATCHDOG_S=150 scripts/gpu/device.sh run python3 scripts/gpu/engine_start.py \
        qwen2.5-vl-7b prefill,decode,full_media_decode

starts the roles one after another, as test_gpu_qwen.py's fixture does, and prints the seconds
each took to be ready (or the error); with WATCHDOG_S, device.sh writes every process's Python
stacks when the start is still going after that long. A third argument, JSON, adds engine
arguments; its `enforce_eager` and `max_model_len` replace the script's eager start at the
model's own length (null: the platform's default, i.e. CUDA graphs on a GPU)."""

from __future__ import annotations

import asyncio
import json
import sys
import time


async def main(shape: str, roles: str, extra: dict) -> None:
    from mmhandoff.models.dummy import ensure_dummy_model
    from mmhandoff.vllm_adapter import EngineSpec, start_engine

    settings = {"enforce_eager": True, "max_model_len": None}
    settings.update({k: extra.pop(k) for k in list(settings) if k in extra})
    engines = []
    for role in roles.split(","):
        t0 = time.perf_counter()
        spec = EngineSpec(model=str(ensure_dummy_model(shape)), role=role, dtype="bfloat16",
                          nixl_port=5600 + len(engines),  # each its own side channel
                          extra={"load_format": "dummy", **extra},
                          gpu_memory_utilization=0.28, **settings)
        engines.append(start_engine(spec))
        print(f"[engine_start] {shape} {role}: ready in {time.perf_counter() - t0:.1f} s",
              flush=True)
    for engine in engines:
        engine.shutdown()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2], json.loads(sys.argv[3]) if len(sys.argv) > 3
                     else {}))
