"""The vLLM internals the adapter leans on. If a vLLM upgrade changes one of them, this fails with
a message naming it (the engine tests would fail too, but less clearly)."""

from __future__ import annotations

import inspect

import msgspec
import pytest

from tests.conftest import engine_cpu_s

pytestmark = pytest.mark.engine


def _params(fn) -> list[str]:
    return list(inspect.signature(fn).parameters)


def test_scheduler_hooks_used_by_the_fail_closed_scheduler():
    from vllm.v1.core.sched.scheduler import Scheduler

    assert _params(Scheduler._try_schedule_encoder_inputs)[:5] == [
        "self", "request", "num_computed_tokens", "num_new_tokens", "encoder_compute_budget"], \
        "Scheduler._try_schedule_encoder_inputs changed its signature"
    src = inspect.getsource(Scheduler._try_schedule_encoder_inputs)
    assert "if num_new_tokens == 0" in src, "the zero-token early return is gone"
    assert _params(Scheduler.finish_requests)[1:] == ["request_ids", "finished_status"]
    assert _params(Scheduler.update_from_output)[1:] == ["scheduler_output", "model_runner_output"]
    schedule = inspect.getsource(Scheduler.schedule)
    assert schedule.count("self._try_schedule_encoder_inputs(") == 2, \
        "schedule() no longer asks _try_schedule_encoder_inputs in both the running and waiting loop"


def test_request_and_output_fields():
    from vllm.multimodal.inputs import MultiModalFeatureSpec
    from vllm.v1.engine import EngineCoreOutput, FinishReason
    from vllm.v1.request import Request, RequestStatus

    fields = set(EngineCoreOutput.__struct_fields__)
    assert {"stop_reason", "kv_transfer_params", "finish_reason"} <= fields
    assert FinishReason.ERROR and RequestStatus.FINISHED_ERROR
    spec = set(inspect.signature(MultiModalFeatureSpec).parameters)
    assert {"data", "modality", "identifier", "mm_position", "mm_hash"} <= spec
    init = inspect.getsource(Request.__init__)
    for attr in ("self.mm_features", "self.num_preemptions", "self.prefill_stats"):
        assert attr in init, f"Request no longer has {attr}"


def test_engine_surfaces():
    from vllm.v1.engine.async_llm import AsyncLLM
    from vllm.v1.engine.input_processor import InputProcessor

    assert "stat_loggers" in _params(AsyncLLM.from_engine_args)
    assert "supported_tasks" in _params(InputProcessor.process_inputs)
    src = inspect.getsource(AsyncLLM.add_request)
    assert "isinstance(prompt, EngineCoreRequest)" in src, "EngineCoreRequest input path removed"


def test_nixl_settings_we_pass_are_read():
    import vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_scheduler as sched
    import vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_worker as worker

    from mmhandoff.prefill.worker import VLLM_KV_LEASE_S

    assert '"kv_lease_duration"' in inspect.getsource(sched)
    assert '"num_threads"' in inspect.getsource(worker)
    # the lease prefill's handoff TTL is derived from when --kv-lease-s is not given
    assert f'"kv_lease_duration", {VLLM_KV_LEASE_S}' in " ".join(
        inspect.getsource(sched).split()), "vLLM's default kv_lease_duration changed"


def test_kv_event_wire_type():
    from vllm.distributed.kv_events import BlockStored, KVEventBatch

    assert {"block_hashes", "parent_block_hash", "token_ids", "block_size", "extra_keys"} <= set(
        BlockStored.__struct_fields__)
    assert issubclass(KVEventBatch, msgspec.Struct)


def test_nixl_agent_config_hook():
    """connector.py hands NIXL a subclass of its config type to set the progress-thread delay."""
    import sys

    from vllm.distributed.nixl_utils import NixlWrapper

    from mmhandoff.vllm_adapter.core.connector import progress_delay

    api = sys.modules[NixlWrapper.__module__]
    src = inspect.getsource(api.nixl_agent.__init__)
    assert "nixlBind.nixlAgentConfig()" in src and "pthrDelay = 0" in src
    with progress_delay(250):
        config = api.nixlBind.nixlAgentConfig()
        config.pthrDelay = 0
        assert config.pthrDelay == 250
    assert api.nixlBind.nixlAgentConfig().__class__.__name__ == "nixlAgentConfig"


def test_engine_compute_threads_stay_on_their_cores(engines):
    """vLLM's NIXL worker re-pins the model's compute thread to the machine's last core on CPU;
    the adapter's connector puts it back: each engine's model runs on the cores it was given
    (conftest: prefill "0", decode and full-media "1")."""
    import os

    import psutil

    for name, engine, cores in (("prefill", engines.prefill, {0}), ("decode", engines.decode, {1}),
                                ("full", engines.full, {1})):
        (core_pid,) = engine.core_pids()
        workers = [p for p in psutil.Process(core_pid).children(recursive=True)
                   if p.name() == "VLLM::Worker"]
        assert workers, name
        for w in workers:  # the worker's main thread is the model's compute thread
            assert os.sched_getaffinity(w.pid) == cores, name


def test_engine_cores_are_reaped_by_one_thread_at_a_time(engines):
    """reaping.py: vLLM's process manager and its monitor thread both wait for the core; the
    adapter serializes `poll` on every engine it starts (tests/test_engine_reaping.py: why)."""
    from vllm.v1.engine.utils import CoreEngineProcManager

    assert "proc.exitcode" in inspect.getsource(CoreEngineProcManager.monitor_engine_liveness)
    for engine in (engines.prefill, engines.decode, engines.full):
        procs = engine.llm.engine_core.resources.engine_manager.processes
        assert procs and all(p._popen.poll.mmhandoff_serialized for p in procs)


def test_shm_ring_reader_fields_used_by_the_spin_plugin():
    """spin.py replaces SpinCondition.wait and reads these reader fields."""
    from vllm.distributed.device_communicators import shm_broadcast

    assert _params(shm_broadcast.SpinCondition.wait) == ["self", "timeout_ms"]
    init = inspect.getsource(shm_broadcast.SpinCondition.__init__)
    for attr in ("self.last_read", "self.poller", "self.local_notify_socket"):
        assert attr in init, f"SpinCondition no longer has {attr}"
    assert "self._spin_condition.wait(" in inspect.getsource(
        shm_broadcast.MessageQueue.acquire_read), "the ring reader no longer waits through it"


@pytest.mark.parametrize("module, default, example, bads", [
    ("spin", 0.002, ("0.05", 0.05), ("fast", "-1", "nan", "11")),
    ("held_kv", 0.01, ("2.5", 0.0025), ("soon", "0", "-1", "nan", "1001")),
])
def test_plugin_setting(monkeypatch, module, default, example, bads):
    import importlib

    plugin = importlib.import_module(f"mmhandoff.vllm_adapter.plugins.{module}")
    read = plugin.spin_seconds if module == "spin" else plugin.poll_seconds
    monkeypatch.delenv(plugin.ENV, raising=False)
    assert read() == default
    monkeypatch.setenv(plugin.ENV, "default")
    assert read() is None
    monkeypatch.setenv(plugin.ENV, example[0])
    assert read() == example[1]
    for bad in bads:
        monkeypatch.setenv(plugin.ENV, bad)
        with pytest.raises(ValueError, match=plugin.ENV):
            read()


def test_engine_core_parts_used_by_the_held_kv_plugin():
    """held_kv.py wraps EngineCoreProc._process_engine_step and reads these engine-core parts."""
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.engine.core import EngineCoreProc

    assert _params(EngineCoreProc._process_engine_step) == ["self"]
    # (run_busy_loop sits under a fault-tolerance wrapper without functools.wraps)
    busy_loop = inspect.getsource(EngineCoreProc).split("def run_busy_loop", 1)[1]
    assert "self._process_engine_step()" in busy_loop.split("\n    def ", 1)[0]
    loop_src = inspect.getsource(EngineCoreProc._process_input_queue)
    assert "self.input_queue.get(" in loop_src and "self._handle_client_request(*req)" in loop_src
    init = inspect.getsource(EngineCoreProc.__init__) + inspect.getsource(
        EngineCoreProc.__mro__[1].__init__)
    for attr in ("self.input_queue", "self.engines_running", "self.batch_queue"):
        assert attr in init, f"the engine core no longer has {attr}"
    # at shutdown the core steps while has_work(), and is_running() says whether it stops
    assert _params(EngineCoreProc.has_work) == ["self"]
    assert _params(EngineCoreProc.is_running) == ["self"]
    assert "self.has_work()" in inspect.getsource(EngineCoreProc._handle_shutdown)
    # the case the plugin paces: vLLM counts finished requests with held blocks as work
    assert "has_finished_requests" in inspect.getsource(Scheduler.has_requests) or \
        "has_finished_requests" in inspect.getsource(Scheduler.__mro__[1].has_requests)


class _Core:
    """The engine-core parts held_kv reads, with a scheduler in a chosen state."""

    def __init__(self, unfinished: bool, held: bool) -> None:
        import queue
        from types import SimpleNamespace

        self.scheduler = SimpleNamespace(has_unfinished_requests=lambda: unfinished,
                                         has_requests=lambda: unfinished or held)
        self.engines_running = False
        self.batch_queue = None
        self.input_queue = queue.Queue()
        self.handled = []

    def _handle_client_request(self, kind, request) -> None:
        self.handled.append((kind, request))


def test_held_kv_paces_only_an_engine_whose_work_is_held_blocks():
    from mmhandoff.vllm_adapter.plugins.held_kv import only_held_blocks

    assert only_held_blocks(_Core(unfinished=False, held=True))
    assert not only_held_blocks(_Core(unfinished=True, held=True))  # e.g. waiting for its pull
    assert not only_held_blocks(_Core(unfinished=True, held=False))


def test_held_kv_wait_ends_when_a_request_arrives():
    import threading
    import time

    from mmhandoff.vllm_adapter.plugins.held_kv import wait_for_input

    core = _Core(unfinished=False, held=True)
    t0 = time.monotonic()
    wait_for_input(core, 0.05)  # nothing comes: waits out its interval
    assert time.monotonic() - t0 >= 0.05 and core.handled == []

    threading.Timer(0.05, core.input_queue.put, args=(("ADD", "r1"),)).start()
    t0 = time.monotonic()
    wait_for_input(core, 30)
    assert core.handled == [("ADD", "r1")]
    assert time.monotonic() - t0 < 10  # woken by the request, not the 30 s interval


def test_engine_processes_stop_spinning_after_a_request(loop, engines):
    """With vLLM's own wait, the model's worker process spins for 1 s after every step (about a
    core for a second); with the plugin it parks within milliseconds. And a parked reader still
    wakes at once: requests spaced past the spin window each finish promptly (a lost ZMQ wake-up
    would otherwise cost vLLM's 5 s re-check)."""
    import time

    from vllm import SamplingParams

    engine = engines.full

    async def one(i: int) -> None:
        params = SamplingParams(max_tokens=4, ignore_eos=True, temperature=0)
        async for _ in engine.llm.generate("a b c d", params, f"spin-{i}"):
            pass

    for i in range(5):
        t0 = time.monotonic()
        loop.run(one(i))
        assert time.monotonic() - t0 < 2.5, f"request {i} stalled"
        time.sleep(0.02)  # longer than the spin window: the worker parks before the next one
    before = engine_cpu_s(engine)
    time.sleep(0.8)  # a measuring window: vLLM's own wait spins through all of it
    used = engine_cpu_s(engine) - before
    assert used < 0.3, f"the engine's processes used {used:.2f} CPU-s in 0.8 s after a request"


def test_process_teardown_parts_used_by_the_fast_exit_plugin():
    """fast_exit.py wraps the `shutdown` of the classes that run in vLLM's own processes, each
    called once as its process ends, and unlinks the shm rings vLLM unlinks only in `__del__`."""
    import multiprocessing.spawn

    from vllm.distributed.device_communicators.shm_broadcast import ShmRingBuffer
    from vllm.v1.engine.core import EngineCoreProc
    from vllm.v1.executor.multiproc_executor import WorkerProc

    core_main = inspect.getsource(EngineCoreProc.run_engine_core)
    assert "engine_core.shutdown()" in core_main.split("finally:")[-1]
    worker_main = inspect.getsource(WorkerProc.worker_main)
    assert "worker.shutdown()" in worker_main.split("finally:")[-1]
    assert "shutdown" in vars(WorkerProc)
    # vLLM's own full collections at teardown, the ones skipped
    from vllm.distributed import parallel_state

    assert "gc.collect()" in inspect.getsource(parallel_state.cleanup_dist_env_and_memory)
    ring_del = inspect.getsource(ShmRingBuffer.__del__)
    assert "self.is_creator" in ring_del and "unlink()" in ring_del
    # a spawned child's last step, which the plugin turns into os._exit
    assert inspect.getsource(multiprocessing.spawn.spawn_main).rstrip().endswith(
        "sys.exit(exitcode)")


def test_what_the_vllm_engine_reads_of_vllm(engines):
    """VllmEngine (vllm_engine.py) and inputs.py read these of vLLM's AsyncLLM and its outputs
    (and the NIXL connector's `remote_block_ids`, which test_admission_engine exercises);
    and the capabilities it derives from them are each role's."""
    import dataclasses

    from vllm.outputs import CompletionOutput, RequestOutput

    from mmhandoff.engine import Capabilities

    llm = engines.decode.llm
    for name in ("model_config", "vllm_config", "renderer", "input_processor", "generate",
                 "abort", "get_supported_tasks", "errored", "output_handler", "engine_core",
                 "shutdown"):
        assert hasattr(llm, name), f"AsyncLLM.{name} is gone"
    for name in ("uses_mrope", "is_encoder_decoder", "multimodal_config", "hf_config", "dtype"):
        assert hasattr(llm.model_config, name), f"ModelConfig.{name} is gone"
    assert llm.vllm_config.cache_config.block_size == 32  # check_blocks reads it
    for name in ("get_tokenizer", "render_cmpl_async", "mm_processor_cache"):
        assert hasattr(llm.renderer, name), f"the renderer's {name} is gone"
    # inputs.not_yet_sent / forget_sent (prefill's bypass discards a render): the prefill
    # engine's mirror of the core's processed-image cache
    cache = engines.prefill.llm.renderer.mm_processor_cache
    assert hasattr(cache, "is_cached_item") and hasattr(cache, "invalidate")
    from vllm.v1.metrics.stats import IterationStats  # EngineLoad counts finished requests

    assert isinstance(IterationStats().finished_requests, list)
    assert {"outputs", "finished", "prompt_token_ids", "kv_transfer_params"} <= set(
        _params(RequestOutput.__init__))
    assert {"token_ids", "text", "finish_reason", "stop_reason"} <= {
        f.name for f in dataclasses.fields(CompletionOutput)}
    assert engines.decode.capabilities == Capabilities(vision=False)
    assert engines.prefill.capabilities == engines.full.capabilities == Capabilities()


def test_what_the_grid_position_state_uses_of_vllm():
    """mmhandoff.vllm_adapter.positions: decode's engine computes an M-RoPE model's positions
    from a data-less feature that holds only the image's grid."""
    from vllm.model_executor.models.qwen2_5_vl import Qwen2_5_VLForConditionalGeneration
    from vllm.model_executor.models.qwen2_vl import Qwen2VLForConditionalGeneration
    from vllm.multimodal.inputs import MultiModalFieldElem
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from mmhandoff.vllm_adapter.positions import GRID_KEY, grid_feature_data
    from mmhandoff.wire.handoff import Grid

    for model in (Qwen2VLForConditionalGeneration, Qwen2_5_VLForConditionalGeneration):
        grids = inspect.getsource(model.iter_mm_grid_thw)
        # the image branch reads the grid field of the feature's data, and nothing else of it
        image_branch = grids.split('== "image"')[1].split('== "video"')[0]
        assert f'data["{GRID_KEY}"]' in image_branch
        assert image_branch.count("data[") == 1
        assert "self.iter_mm_grid_thw(mm_features)" in inspect.getsource(
            model.get_mrope_input_positions)
    runner = inspect.getsource(GPUModelRunner._init_mrope_positions)
    assert "req_state.mm_features" in runner and "get_mrope_input_positions(" in runner
    # once an image's span is covered by KV, workers get only its keep_on_cpu fields
    from vllm.multimodal import utils as mm_utils

    strip = inspect.getsource(mm_utils.strip_covered_mm_data)
    assert "uses_mrope" in strip and "keep_on_cpu" in strip
    assert {"data", "field"} <= set(_params(MultiModalFieldElem))
    item = grid_feature_data("image", Grid(t=1, h=4, w=6))
    assert set(item) == {GRID_KEY} and item[GRID_KEY].data.tolist() == [1, 4, 6]
    assert item[GRID_KEY].field.keep_on_cpu
    # a video's grid and (Qwen2.5-VL) its seconds per step: the fields and their `.item()`
    # that Qwen2.5-VL's iter_mm_grid_thw reads
    from mmhandoff.vllm_adapter.positions import GRID_KEYS, SECONDS_KEY

    video = grid_feature_data("video", Grid(t=3, h=4, w=6, seconds=2.0))
    assert set(video) == {GRID_KEYS["video"], SECONDS_KEY}
    assert video[GRID_KEYS["video"]].data.tolist() == [3, 4, 6]
    assert video[SECONDS_KEY].data.item() == 2.0 and video[SECONDS_KEY].field.keep_on_cpu
    from vllm.model_executor.models.qwen2_5_vl import Qwen2_5_VLForConditionalGeneration

    iterate = inspect.getsource(Qwen2_5_VLForConditionalGeneration.iter_mm_grid_thw)
    assert '"video_grid_thw"' in iterate and '"second_per_grid_ts"' in iterate
