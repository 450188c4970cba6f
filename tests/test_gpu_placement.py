"""serve's GPU placement (serve/gpus.py) and what each replica starts with: the arithmetic on
the CPU; tests/test_gpu.py's served graphs run it on a GPU (docs/gpu.md)."""

from __future__ import annotations

import shutil

import pytest
import yaml

from mmhandoff.serve import supervisor as supervisor_mod
from mmhandoff.serve.gpus import PlacementError, Slot, place, share_args, visible_gpus
from mmhandoff.serve.supervisor import GraphError, Supervisor, load_graph

pytestmark = pytest.mark.unit


def test_one_gpu_per_engine_while_the_host_has_enough():
    engines = [("decode", 2, {}), ("prefill", 2, {})]
    assert place(engines, ["0", "1", "2", "3"]) == {
        "decode-0": Slot("0", None), "decode-1": Slot("1", None),
        "prefill-0": Slot("2", None), "prefill-1": Slot("3", None)}
    assert place([("agg", 1, {})], ["0"]) == {"agg-0": Slot("0", None)}


def test_engines_that_share_a_gpu_get_explicit_shares_and_start_in_turn():
    engines = [("decode", 1, {"gpu_share": 0.45}), ("prefill", 1, {"gpu_share": 0.45})]
    assert place(engines, ["0"]) == {"decode-0": Slot("0", 0.45),
                                     "prefill-0": Slot("0", 0.45, ("decode-0",))}
    # without a share: equal parts of what the GPU's engines may take together
    slots = place([("decode", 2, {}), ("prefill", 2, {})], ["0", "1"])
    assert {n: (s.gpu, s.share) for n, s in slots.items()} == {
        "decode-0": ("0", 0.45), "decode-1": ("1", 0.45),
        "prefill-0": ("0", 0.45), "prefill-1": ("1", 0.45)}
    assert slots["prefill-0"].shared_with == ("decode-0",)
    assert sum(s.share for s in slots.values() if s.gpu == "0") <= 0.9


def test_a_placement_that_cannot_fit_is_refused_with_the_arithmetic():
    engines = [("decode", 2, {"gpu_share": 0.3}), ("prefill", 2, {"gpu_share": 0.3})]
    with pytest.raises(PlacementError) as e:
        place(engines, ["0"])
    assert "decode-0 0.30 + decode-1 0.30 + prefill-0 0.30 + prefill-1 0.30 = 1.20" in str(e.value)
    assert "GPU 0" in str(e.value)
    place(engines, ["0", "1"])  # two GPUs: 0.6 each, fits


@pytest.mark.parametrize("spec, match", [
    ({"gpus": [2]}, r"names \[2\], but serve may use 2 GPUs here \(0..1\)"),
    ({"gpus": "0"}, "must be a nonempty list"),
    ({"gpus": []}, "must be a nonempty list"),
    ({"gpu_share": 1.5}, r"fraction in \(0, 1\]"),
    ({"gpu_share": "half"}, r"fraction in \(0, 1\]"),
])
def test_bad_gpu_settings_are_refused(spec, match):
    with pytest.raises(PlacementError, match=match):
        place([("decode", 1, spec)], ["0", "1"])


def test_named_gpus_are_taken_in_turn_and_an_engine_arg_share_counts():
    engines = [("decode", 3, {"gpus": [1]}),
               ("prefill", 1, {"gpus": [0], "args": ["--engine-arg",
                                                     "gpu_memory_utilization=0.5"]}),
               ("agg", 1, {"gpus": [0], "gpu_share": 0.3})]
    slots = place(engines, ["4", "5"])  # CUDA_VISIBLE_DEVICES=4,5: index 1 is GPU 5
    assert [slots[f"decode-{i}"].gpu for i in range(3)] == ["5", "5", "5"]
    assert [slots[f"decode-{i}"].share for i in range(3)] == [0.3, 0.3, 0.3]
    assert slots["prefill-0"] == Slot("4", 0.5)  # its engine argument is its share
    assert slots["agg-0"] == Slot("4", 0.3, ("prefill-0",))
    # the YAML's own engine argument is not given twice
    assert share_args(engines[1][2], slots["prefill-0"]) == []
    assert share_args({}, slots["decode-0"]) == ["--engine-arg", "gpu_memory_utilization=0.3"]
    assert share_args({}, Slot("0", None)) == []


def test_replicas_without_named_gpus_go_first_to_the_gpus_nobody_names():
    slots = place([("prefill", 1, {"gpus": [0]}), ("decode", 2, {})], ["0", "1", "2"])
    assert {n: s.gpu for n, s in slots.items()} == {"prefill-0": "0", "decode-0": "1",
                                                     "decode-1": "2"}
    assert all(s.share is None for s in slots.values())
    # every GPU named: the others share them in turn
    slots = place([("prefill", 1, {"gpus": [0]}), ("decode", 1, {})], ["0"])
    assert slots["decode-0"] == Slot("0", 0.45, ("prefill-0",))


def test_a_host_without_gpus_places_nothing_and_refuses_named_gpus():
    assert place([("decode", 1, {})], []) == {}
    with pytest.raises(PlacementError, match="this host has none"):
        place([("decode", 1, {"gpus": [0]})], [])
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": "2, 3"}) == ["2", "3"]
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": ""}) == []


def _supervisor(monkeypatch, config_path: str, target: str, gpus: list[str]):
    monkeypatch.setattr(supervisor_mod, "visible_gpus", lambda env: gpus)
    return Supervisor(load_graph(target), yaml.safe_load(open(config_path)), port=None)


def test_serve_starts_replicas_sharing_a_gpu_one_after_another(monkeypatch):
    sup = _supervisor(monkeypatch, "configs/gpu/disagg_router.yaml",
                      "graphs.disagg_router:Frontend", ["0"])
    launched = []
    monkeypatch.setattr(sup, "_launch", lambda c, i: launched.append(f"{c.module}-{i}")
                        or type("R", (), {"name": f"{c.module}-{i}"})())
    try:
        sup.start()
        # the frontend and the router start at once; of the four engines only the first
        assert sorted(launched) == ["decode-0", "frontend-0", "router-0"]
        sup.ready.add("decode-0")
        sup.start_due()
        assert launched[-1] == "decode-1"
        for name in ("decode-1", "prefill-0"):
            sup.ready.add(name)
            sup.start_due()
        assert launched[-1] == "prefill-1" and not sup.pending
        assert {s.share for s in sup.slots.values()} == {0.22}
    finally:
        shutil.rmtree(sup.run_dir, ignore_errors=True)


def test_each_replica_gets_its_gpu_and_share_in_its_environment(monkeypatch):
    sup = _supervisor(monkeypatch, "configs/gpu/disagg.yaml", "graphs.disagg:Frontend", ["0"])
    started = {}

    class Proc:
        pid, stdout = 0, iter(())

    def popen(command, env, **kw):
        started[command[2]] = (command, env)
        return Proc()

    monkeypatch.setattr(supervisor_mod.subprocess, "Popen", popen)
    try:
        sup.start()
        sup.ready.add("decode-0")
        sup.start_due()
        decode, prefill = started["mmhandoff.decode"], started["mmhandoff.prefill"]
        for command, env in (decode, prefill):
            assert env["CUDA_VISIBLE_DEVICES"] == "0"
            args = [command[i + 1] for i, a in enumerate(command) if a == "--engine-arg"]
            assert "gpu_memory_utilization=0.45" in args
            assert command[command.index("--model") + 1] == "dummy:llava-1.5-7b"
        assert "renderer_num_workers=8" in prefill[0]  # the YAML's own args are kept
        assert "CUDA_VISIBLE_DEVICES" not in started["mmhandoff.frontend"][1]
    finally:
        shutil.rmtree(sup.run_dir, ignore_errors=True)


def test_a_graph_that_cannot_fit_is_refused_before_anything_starts(monkeypatch, tmp_path):
    config = yaml.safe_load(open("configs/gpu/disagg_router.yaml"))
    config["components"]["decode"]["gpu_share"] = 0.4
    monkeypatch.setattr(supervisor_mod, "visible_gpus", lambda env: ["0"])
    monkeypatch.setattr(supervisor_mod.subprocess, "Popen",
                        lambda *a, **k: pytest.fail("a process started"))
    with pytest.raises(GraphError, match=r"= 1\.24 of its memory"):
        Supervisor(load_graph("graphs.disagg_router:Frontend"), config, port=None)


@pytest.mark.parametrize("graph", ["agg", "disagg", "disagg_router"])
def test_every_gpu_config_places_on_one_gpu_and_on_one_gpu_per_engine(monkeypatch, graph):
    for gpus in (["0"], [str(i) for i in range(8)]):
        sup = _supervisor(monkeypatch, f"configs/gpu/{graph}.yaml", f"graphs.{graph}:Frontend",
                          gpus)
        shutil.rmtree(sup.run_dir, ignore_errors=True)
        if len(gpus) > 1:  # one GPU each, vLLM's default share
            assert len({s.gpu for s in sup.slots.values()}) == len(sup.slots)
            assert all(s.share is None for s in sup.slots.values())
