"""The graph is the one source of wiring: `serve` tells each component its callees' endpoints
from the graph's links, and a YAML that tries to wire is refused."""

from __future__ import annotations

import shutil

import pytest
import yaml

from mmhandoff.serve.supervisor import (
    GraphError,
    Supervisor,
    check_config,
    graph_env,
    load_graph,
)

pytestmark = pytest.mark.unit


def _by_module(target: str) -> dict:
    return {c.module: c for c in load_graph(target)}


NO_ROUTER = {"prefill": {"router": None}}


@pytest.mark.parametrize("target, frontend, others", [
    ("graphs.disagg:Frontend", {"prefill": "prefill.generate", "decode": "decode.generate",
                                "router": None}, NO_ROUTER),
    ("graphs.full_media:Frontend",
     {"prefill": "prefill.generate", "decode": "decode.generate", "router": None}, NO_ROUTER),
    ("graphs.agg:Frontend", {"prefill": None, "decode": "agg.generate", "router": None}, {}),
    # the frontend asks the router which prefill replica takes a request, and sends prefill's
    # handoff through it to decode; prefill asks the router whether a decode replica holds a
    # prompt's KV (bypass)
    ("graphs.disagg_router:Frontend", {"prefill": "prefill.generate", "decode": "router.generate",
                                       "router": "router.generate"},
     {"router": {"decode": "decode.generate"}, "prefill": {"router": "router.generate"}}),
])
def test_each_component_is_wired_to_the_nearest_callee_serving_each_role(
        target, frontend, others):
    graph = _by_module(target)
    assert graph["frontend"].wiring() == frontend
    for module, wiring in others.items():
        assert graph[module].wiring() == wiring
    for module in ("decode", "agg"):  # they call nobody
        assert module not in graph or graph[module].wiring() == {}


def _commands(target: str, config_path: str) -> dict[str, list[str]]:
    config = yaml.safe_load(open(config_path))
    components = load_graph(target)
    check_config(components, config, config_path, target)
    sup = Supervisor(components, config, port=None)
    try:
        return {c.module: sup.command(c) for c in components}
    finally:
        shutil.rmtree(sup.run_dir, ignore_errors=True)


def _flag(command: list[str], flag: str) -> str:
    assert command.count(flag) == 1, command
    return command[command.index(flag) + 1]


def test_serve_passes_the_wiring_as_flags():
    agg = _commands("graphs.agg:Frontend", "configs/agg.yaml")["frontend"]
    assert (_flag(agg, "--prefill"), _flag(agg, "--decode")) == ("none", "agg.generate")
    routed = _commands("graphs.disagg_router:Frontend", "configs/disagg_router.yaml")
    assert _flag(routed["frontend"], "--decode") == "router.generate"
    assert _flag(routed["frontend"], "--router") == "router.generate"  # it places prefill
    assert _flag(routed["router"], "--decode") == "decode.generate"
    assert _flag(routed["prefill"], "--router") == "router.generate"
    plain = _commands("graphs.disagg:Frontend", "configs/disagg.yaml")
    assert _flag(plain["prefill"], "--router") == "none"
    assert _flag(plain["frontend"], "--router") == "none"
    assert routed["decode"][1:3] == ["-m", "mmhandoff.decode"]


def test_the_router_graph_with_the_plain_config_still_goes_through_the_router():
    # a YAML used to carry "--decode router.generate": with disagg's YAML the router was skipped
    routed = _commands("graphs.disagg_router:Frontend", "configs/disagg.yaml")
    assert _flag(routed["frontend"], "--decode") == "router.generate"


def test_a_config_that_wires_is_refused(tmp_path):
    config = yaml.safe_load(open("configs/disagg.yaml"))
    config["components"]["frontend"]["args"] += ["--decode", "decode.generate"]
    with pytest.raises(GraphError, match="--decode, which the graph wires"):
        check_config(load_graph("graphs.disagg:Frontend"), config, "x.yaml", "graphs.disagg")
    config["components"]["frontend"]["args"][-2:] = ["--prefill=none"]
    with pytest.raises(GraphError, match="--prefill"):
        check_config(load_graph("graphs.disagg:Frontend"), config, "x.yaml", "graphs.disagg")


def test_every_graph_run_signs_its_handoffs_with_a_key_of_its_own(tmp_path):
    from mmhandoff.plane.handoff_keys import KEY_ENV, KEY_FILE_ENV

    base = {"PATH": "/bin"}
    first, second = (graph_env({}, base, tmp_path)[KEY_ENV] for _ in range(2))
    assert first != second and len(bytes.fromhex(first)) == 32
    # a key the user gives (the YAML's env, or serve's own environment) is kept
    assert graph_env({"env": {KEY_ENV: "x" * 32}}, base, tmp_path)[KEY_ENV] == "x" * 32
    given = graph_env({}, {**base, KEY_FILE_ENV: "/run/secrets/handoff"}, tmp_path)
    assert KEY_ENV not in given
