"""Building vLLM engines for each role of the graph.

Roles:
- "agg": the whole VLM, no KV transfer (the baseline, and the parity reference).
- "prefill": the whole VLM; NixlConnector as KV producer (prefill answers with
  `kv_transfer_params` that name its blocks, and holds them until pulled or the lease ends).
- "decode": NixlConnector as KV consumer; no vision tower (no media input makes vLLM skip
  building it), no receiver cache, the fail-closed scheduler, KV load failures fail.
- "full_media_decode": a KV consumer with the whole VLM, for the benchmark arm where decode
  receives the images again (what P/D stacks do today).

Engines run their core in a spawned process that inherits the environment at start: the CPU
binding, KV cache size and NIXL side-channel port are set per engine around its construction.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import socket
import tempfile
from dataclasses import dataclass, field
from typing import Any, Iterator, Literal

Role = Literal["agg", "prefill", "decode", "full_media_decode"]
ROLES: tuple[Role, ...] = ("agg", "prefill", "decode", "full_media_decode")
KV_READERS: tuple[Role, ...] = ("decode", "full_media_decode")  # they pull KV with NIXL READ

FAIL_CLOSED_SCHEDULER = "mmhandoff.vllm_adapter.core.scheduler.FailClosedScheduler"
KV_STATS_SCHEDULER = "mmhandoff.vllm_adapter.core.scheduler.KvStatsScheduler"
CONNECTOR = "mmhandoff.vllm_adapter.core.connector.MMHandoffNixlConnector"
RELEASE_EXTENSION = "mmhandoff.vllm_adapter.core.release.HandoffRelease"  # (core.release)


# What an EngineSpec field left at None becomes, per platform; a GPU takes vLLM's own default
# for each (a missing entry). On a CPU: eager (compiling the model costs minutes on 2 cores for
# nothing), a context that fits the tests' prompts, and a batch the 2-core machine can step.
PLATFORM_DEFAULTS: dict[str, dict[str, Any]] = {
    "cpu": {"max_model_len": 2048, "max_num_seqs": 8, "enforce_eager": True},
    "gpu": {},
}
# vLLM runs the model's image processor for one request at a time, on one thread, unless it has
# more renderer workers, which it allows only without its processed-image cache (not
# thread-safe), the cache that lets a repeated image reach the engine without its pixels. On an
# H100 host, 8 threads took 12 MP TTFT at 8 in flight from 1205 to 1056 ms but a follow-up turn's
# from 74 to 400 ms (docs/benchmarks.md): vLLM's one thread stays the default on every
# platform; "auto": this many threads at most, and no more than the process's cores.
AUTO_RENDERER_WORKERS = 8
# vLLM's renderer runs the image processor on OMP_NUM_THREADS torch threads, one if unset, and
# reads the variable at every render. An engine core that inherits the variable at its start
# hung at model load on an H100 (docs/benchmarks.md): the worker sets it only once its engine's
# core is up, marks it as its own, and takes it out of the environment while another engine of
# the same process starts.
RENDERER_THREADS_MARK = "MMHANDOFF_RENDERER_OMP_NUM_THREADS"


@dataclass
class EngineSpec:
    """What a role needs to start one engine; everything else takes vLLM's defaults."""

    model: str
    role: Role
    block_size: int = 32  # vLLM CPU attention needs a multiple of 32
    # None: the platform's default (PLATFORM_DEFAULTS): vLLM's own on a GPU (CUDA graphs and
    # compilation, its batch limit, the model's context length), small ones on a CPU
    max_model_len: int | None = None
    max_num_seqs: int | None = None
    enforce_eager: bool | None = None
    # threads processing images in vLLM's renderer: None: vLLM's one, with its processed-image
    # cache (a repeated image then travels without pixels); "auto" or more than one: side by
    # side, and no cache
    renderer_workers: int | str | None = None
    # torch threads for each image the renderer processes: None: vLLM's (OMP_NUM_THREADS if the
    # process was started with it, else one); "auto": AUTO_RENDERER_WORKERS at most, and no more
    # than the process's cores
    renderer_torch_threads: int | str | None = None
    dtype: str = "auto"
    seed: int = 0
    kv_cache_gib: int = 1  # CPU only (VLLM_CPU_KVCACHE_SPACE)
    num_gpu_blocks_override: int | None = None  # a tiny cache forces preemption in tests
    cpu_cores: str | None = None  # e.g. "0" or "0-1" (VLLM_CPU_OMP_THREADS_BIND)
    nixl_port: int | None = None  # the NIXL side channel (handshake) port of this engine
    nixl_host: str = "127.0.0.1"
    nixl_threads: int = 0  # extra UCX worker threads (vLLM's default is 4)
    # NIXL's progress thread polls back to back by default and burns a core (connector.py);
    # it sleeps this long between polls instead. 0: NIXL's own behaviour.
    nixl_progress_delay_us: int = 100
    kv_buffer_device: str | None = None  # "cpu" on CPU machines, None = vLLM's default
    kv_lease_s: int | None = None  # how long prefill holds unpulled blocks
    kv_events_endpoint: str | None = None  # ZMQ endpoint for KV events ("tcp://*:port": bind)
    connector_module: str | None = None  # default: CONNECTOR; tests inject faults with another
    gpu_memory_utilization: float | None = None  # GPU: this engine's share (two on one GPU)
    # Every engine of a graph must derive the same first block hash, or prefill, decode and the
    # router disagree on every block: vLLM 0.26 draws it from os.urandom unless PYTHONHASHSEED
    # is set (0.31 uses a fixed default). Set explicitly on every version.
    block_hash_seed: int = 0
    # GPU: let UCX serve NIXL's READ (decode's pull) through cuda_ipc. UCX turns cuda_ipc's GET
    # off when it sees no active NVLink (one GPU, PCIe-only hosts), and the pull then falls back
    # to "software emulation" over TCP: 0.6 GB/s instead of 17 GB/s on an H200 (docs/gpu.md).
    # Only the engines that read (decode) get it: the reader's UCX picks the protocol.
    # False leaves UCX's own choice ("auto").
    cuda_ipc_get: bool = True
    # GPU: each KV block holds every layer side by side, so NIXL moves one descriptor per block
    # instead of one per layer and K/V (64x fewer for a 32-layer model). cuda_ipc pays ~8 us per
    # descriptor whatever its size, which bounds the pull (docs/gpu.md). Every engine that moves
    # KV must agree: vLLM's NIXL handshake refuses a peer with the other layout. On an H100 it
    # halved decode's first token at 8 in flight (docs/gpu.md); False: vLLM's per-layer layout.
    kv_blocks_across_layers: bool = True
    extra: dict[str, Any] = field(default_factory=dict)  # passed to AsyncEngineArgs as is

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"unknown engine role {self.role!r}; expected one of {ROLES}")
        if not 0 <= self.block_hash_seed <= 2**32 - 1:  # what PYTHONHASHSEED accepts
            raise ValueError(
                f"block_hash_seed must be in [0, 2**32 - 1], got {self.block_hash_seed}")
        if self.renderer_workers not in (None, "auto"):
            _check_renderer_workers(self.renderer_workers)
        if self.renderer_torch_threads not in (None, "auto"):
            _check_renderer_workers(self.renderer_torch_threads, "renderer torch threads")


def _check_renderer_workers(workers: Any, what: str = "renderer workers") -> None:
    if not isinstance(workers, int) or isinstance(workers, bool) or workers < 1:
        raise ValueError(f"{what} must be a positive integer or 'auto', got {workers!r}")


def _auto_threads() -> int:
    from mmhandoff.process.cores import usable_cores

    return min(AUTO_RENDERER_WORKERS, usable_cores())


def on_cpu() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


def engine_args(spec: EngineSpec):
    from vllm.config import KVEventsConfig, KVTransferConfig
    from vllm.engine.arg_utils import AsyncEngineArgs

    kw: dict[str, Any] = dict(
        model=spec.model,
        tokenizer=spec.model,
        block_size=spec.block_size,
        **platform_settings(spec, "cpu" if on_cpu() else "gpu"),
        dtype=spec.dtype,
        seed=spec.seed,
        enable_prefix_caching=True,
        disable_log_stats=False,  # per-request prefill stats: local vs external (pulled) tokens
    )
    if spec.num_gpu_blocks_override:
        kw["num_gpu_blocks_override"] = spec.num_gpu_blocks_override
    if spec.gpu_memory_utilization is not None:
        kw["gpu_memory_utilization"] = spec.gpu_memory_utilization
    if spec.role != "agg":
        extra: dict[str, Any] = {
            "num_threads": spec.nixl_threads, "backends": ["UCX"],
            "progress_delay_us": spec.nixl_progress_delay_us,
        }
        if spec.kv_lease_s is not None:
            extra["kv_lease_duration"] = spec.kv_lease_s
        extra.update(_blocks_across_layers(spec)[1])
        module = spec.connector_module or CONNECTOR
        connector = dict(
            kv_connector=module.rsplit(".", 1)[1],
            kv_connector_module_path=module.rsplit(".", 1)[0],
            kv_role="kv_producer" if spec.role == "prefill" else "kv_consumer",
            kv_load_failure_policy="fail",
            kv_connector_extra_config=extra,
        )
        if spec.kv_buffer_device or on_cpu():
            connector["kv_buffer_device"] = spec.kv_buffer_device or "cpu"
        kw["kv_transfer_config"] = KVTransferConfig(**connector)
    if spec.role == "prefill":  # frees blocks of handoffs nobody will claim
        kw["worker_extension_cls"] = RELEASE_EXTENSION
    if spec.role == "decode":
        kw.update(_no_vision_tower(spec.model))
        kw["mm_processor_cache_gb"] = 0
        kw["scheduler_cls"] = FAIL_CLOSED_SCHEDULER
    elif spec.role == "full_media_decode":  # reports what it pulled, as decode does
        kw["scheduler_cls"] = KV_STATS_SCHEDULER
    if spec.kv_events_endpoint:
        kw["kv_events_config"] = KVEventsConfig(
            enable_kv_cache_events=True, publisher="zmq", endpoint=spec.kv_events_endpoint,
            topic="kv-events",
        )
    kw.update(renderer_settings(spec))
    kw.update(spec.extra)
    return AsyncEngineArgs(**kw)


def renderer_settings(spec: EngineSpec) -> dict[str, Any]:
    """How many threads process a request's images (vLLM's renderer workers), and the cache
    setting that many requires. An --engine-arg renderer_num_workers (or mm_processor_cache_gb)
    wins; decode processes no media."""
    if spec.role == "decode":
        return {}
    workers = spec.extra.get("renderer_num_workers", spec.renderer_workers)
    if workers is None:
        workers = 1  # vLLM's, with its cache, on every platform (AUTO_RENDERER_WORKERS)
    if workers == "auto":
        workers = _auto_threads()
    _check_renderer_workers(workers)
    out: dict[str, Any] = {"renderer_num_workers": workers}
    if workers > 1 and "mm_processor_cache_gb" not in spec.extra:
        out["mm_processor_cache_gb"] = 0
    return out


def platform_settings(spec: EngineSpec, platform: str) -> dict[str, Any]:
    """The spec's batch, context and compilation settings: each one set in the spec, else the
    platform's default; one neither sets is left to vLLM."""
    out = {}
    for name in ("max_model_len", "max_num_seqs", "enforce_eager"):
        value = getattr(spec, name)
        if value is None:
            value = PLATFORM_DEFAULTS[platform].get(name)
        if value is not None:
            out[name] = value
    return out


def _no_vision_tower(model: str) -> dict[str, Any]:
    """Engine arguments under which vLLM builds none of the model's vision encoders: each medium
    its family takes at 0 (vllm_adapter.families; Qwen2-VL's tower serves images and video: with
    images alone at 0 vLLM still built it). A model of no known family: images, and video if its
    config names a video token. LLaVA keeps the image limit alone, as its decode engine was
    always started (a video limit for LLaVA is taken, but two clean-clone CI runs with a changed
    LLaVA decode configuration failed a kill test's clean-stop check)."""
    import json
    from pathlib import Path

    from mmhandoff.vllm_adapter.families import family

    path = Path(model) / "config.json"
    config = json.loads(path.read_text()) if path.is_file() else {}
    known = family(config.get("model_type"))
    if known is not None:
        media = known.media
    else:
        takes_video = any(k in config for k in ("video_token_id", "video_token_index"))
        media = ("image", "video") if takes_video else ("image",)
    return {"limit_mm_per_prompt": dict.fromkeys(media, 0)}


def engine_env(spec: EngineSpec) -> dict[str, str]:
    """Environment the engine core process must start with."""
    env = {"PYTHONHASHSEED": str(spec.block_hash_seed)}
    # Kernels vLLM compiles with torch.compile even in eager mode (its CPU sampler: 15 s on 2
    # cores, VllmEngine.warm_up) are kept across runs in mmhandoff's cache, not in the temp dir
    # (importing vLLM points torch there), which serve makes per run.
    from mmhandoff.cache import cache_root

    env["TORCHINDUCTOR_CACHE_DIR"] = str(cache_root() / "torchinductor")
    if on_cpu():
        env["VLLM_CPU_KVCACHE_SPACE"] = str(spec.kv_cache_gib)
        if spec.cpu_cores is not None:
            env["VLLM_CPU_OMP_THREADS_BIND"] = spec.cpu_cores
    if spec.role != "agg":
        env["VLLM_NIXL_SIDE_CHANNEL_HOST"] = spec.nixl_host
        if spec.nixl_port is not None:
            env["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(spec.nixl_port)
        if not on_cpu() and spec.role in KV_READERS:
            env["UCX_CUDA_IPC_ENABLE_GET_ZCOPY"] = "y" if spec.cuda_ipc_get else "auto"
        env.update(_blocks_across_layers(spec)[0])
    return env


def _blocks_across_layers(spec: EngineSpec) -> tuple[dict[str, str], dict[str, str]]:
    """(environment, connector extra config) that make each KV block contiguous across layers.

    Differs by vLLM version (named here, tested in test_engine_spec.py):
    - 0.26 (the lent GPU): the HND layout plus NixlConnector's `enable_cross_layers_blocks`;
      vLLM then allocates one tensor (blocks, heads, layers, tokens, K|V) and NIXL registers one
      descriptor per block. Measured on an H100 (docs/gpu.md).
    - 0.31 replaced both by a layout name (`VLLM_KV_CACHE_LAYOUT=BLHNC`) that only some
      attention backends accept (FlashInfer, not FlashAttention): not applied, since no GPU
      here runs 0.31 to test it; the engines keep vLLM's per-layer layout.
    Nothing on CPU: the CPU attention backend has the per-layer layout only."""
    if on_cpu() or spec.role == "agg" or not spec.kv_blocks_across_layers:
        return {}, {}
    if _layout_names_blocks_outermost():
        return {}, {}
    return {"VLLM_KV_CACHE_LAYOUT": "HND"}, {"enable_cross_layers_blocks": "True"}


def _layout_names_blocks_outermost() -> bool:
    """True on vLLM versions whose KV cache layouts are named by stride order (0.31)."""
    import importlib.util

    return importlib.util.find_spec("vllm.v1.kv_cache_layout") is not None


def renderer_threads_env(spec: EngineSpec, environ: dict[str, str]) -> dict[str, str]:
    """What the worker's environment takes once the engine's core is up, so that vLLM's renderer
    processes images on the spec's torch threads: {} when the spec leaves vLLM's choice, the
    engine processes no media, or OMP_NUM_THREADS came from outside (the user's wins)."""
    threads = spec.renderer_torch_threads
    if threads is None or spec.role == "decode":
        return {}
    if "OMP_NUM_THREADS" in environ and RENDERER_THREADS_MARK not in environ:
        return {}
    threads = _auto_threads() if threads == "auto" else threads
    return {"OMP_NUM_THREADS": str(threads), RENDERER_THREADS_MARK: "1"}


def _start_environ(environ: dict[str, str]) -> dict[str, str | None]:
    """The renderer's thread count taken out while an engine core starts (renderer_threads_env)."""
    if RENDERER_THREADS_MARK not in environ:
        return {}
    return {"OMP_NUM_THREADS": None, RENDERER_THREADS_MARK: None}


@contextlib.contextmanager
def _patched_environ(values: dict[str, str | None]) -> Iterator[None]:
    """`values` set (None: removed) for the block, then put back as they were."""
    saved = {k: os.environ.get(k) for k in values}
    for k, v in values.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def start_engine(spec: EngineSpec, load=None):
    """Start the engine for `spec` (blocks until its core is up, ~25 s for the tiny model on
    CPU): a VllmEngine, the mmhandoff.engine.Engine the workers use. `load`, an EngineLoad, is
    kept up to date with the engine's scheduler stats."""
    check_side_channel_port(spec)
    from mmhandoff.vllm_adapter.vllm_engine import VllmEngine

    # vLLM's ZMQ sockets between the engine and its core are files in VLLM_RPC_BASE_PATH (the
    # temp dir) that vLLM leaves behind (7 per engine): a directory of the engine's own, removed
    # when it stops.
    ipc_dir = tempfile.mkdtemp(prefix="mmhandoff-vllm-ipc-")
    try:
        return VllmEngine(start_llm(spec, load, ipc_dir), ipc_dir,
                          block_hash_seed=spec.block_hash_seed)
    except BaseException:
        shutil.rmtree(ipc_dir, ignore_errors=True)
        raise


class SideChannelPortInUse(OSError):
    """Another process listens on the engine's NIXL side-channel port."""


def check_side_channel_port(spec: EngineSpec) -> None:
    """Refuse to start an engine whose NIXL side-channel port is taken: vLLM's connector fails
    to bind it in a thread of the engine core, and the engine's start then waits forever
    instead of failing (seen on an H100: two engines left at vLLM's default port 5600)."""
    if spec.role == "agg":  # no connector, no side channel
        return
    port = spec.nixl_port
    if port is None:
        port = int(os.environ.get("VLLM_NIXL_SIDE_CHANNEL_PORT", "5600"))  # vLLM's default
    family = socket.AF_INET6 if ":" in spec.nixl_host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as ZMQ binds
        try:
            probe.bind((spec.nixl_host, port))
        except OSError as e:
            if e.errno != errno.EADDRINUSE:
                return  # (an address not on this host: vLLM's own bind decides)
            raise SideChannelPortInUse(
                e.errno, f"the {spec.role} engine's NIXL side-channel port {port} on "
                f"{spec.nixl_host} is in use (another engine?): give each engine its own "
                "port (EngineSpec.nixl_port; serve allocates them)") from None


def start_llm(spec: EngineSpec, load=None, ipc_dir: str | None = None):
    """vLLM's AsyncLLM for `spec`; its sockets' files in `ipc_dir` if given."""
    from vllm.usage.usage_lib import UsageContext
    from vllm.v1.engine.async_llm import AsyncLLM

    from mmhandoff.vllm_adapter.engine_core import core_processes
    from mmhandoff.vllm_adapter.reaping import serialize_reaping

    loggers = [load.logger_factory()] if load is not None else None
    env = engine_env(spec) | ({"VLLM_RPC_BASE_PATH": ipc_dir} if ipc_dir else {})
    with _patched_environ(env | _start_environ(dict(os.environ))):
        # the batch defaults `vllm serve` gets: vLLM sizes them by usage context, and
        # AsyncLLM's own (ENGINE_CONTEXT) is in none of its tables, so an engine started without
        # one got the bare SchedulerConfig defaults (2048 batched tokens, 128 sequences; `vllm
        # serve` on an H100: 8192 and 1024): at 32 in flight, 0.78x its throughput (docs/gpu.md)
        llm = AsyncLLM.from_engine_args(engine_args(spec), stat_loggers=loggers,
                                        usage_context=UsageContext.OPENAI_API_SERVER)
    serialize_reaping(core_processes(llm))
    os.environ.update(renderer_threads_env(spec, dict(os.environ)))
    return llm
