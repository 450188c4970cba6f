"""deploy/k8s: every overlay renders with `kubectl kustomize`; each DynamoGraphDeployment is
valid against the operator's CRD (v1beta1 OpenAPI schema, tests/data/k8s-crds, through
openapi-schema-validator), every other object against Kubernetes' own schemas (kubernetes-validate),
both strict: a field the schema does not know is an error, as `kubectl apply` (strict field
validation) makes it. A misspelt field and a wrong type fail both. Every component's command
exists (`--help`) and its args parse with that component's own parser. The image and the runtime
version the manifests declare are the ones pyproject pins."""

from __future__ import annotations

import copy
import re
import subprocess
import sys
from functools import lru_cache
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]
K8S = ROOT / "deploy" / "k8s"
OVERLAYS = sorted(p.name for p in (K8S / "overlays").iterdir())
CRD = ROOT / "tests" / "data" / "k8s-crds" / "nvidia.com_dynamographdeployments.yaml"
CRD_SHA256 = "055d7331cfbf1cca6864ee9005239de7e869dd79d69418126a52634d009c55d8"  # SOURCE.md
KUBERNETES = "1.37.0"  # the newest schemas kubernetes-validate ships
LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # libyaml: the CRD in 0.15 s, not 5


def render(path: Path) -> list[dict]:
    out = subprocess.run(["kubectl", "kustomize", str(path)], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.load_all(out.stdout, Loader=LOADER) if d]


def _strict(schema):
    """The schema with unknown fields refused wherever it lists an object's fields and does not
    keep unknown ones (x-kubernetes-preserve-unknown-fields)."""
    if isinstance(schema, dict):
        schema = {k: _strict(v) for k, v in schema.items()}
        if ("properties" in schema and "additionalProperties" not in schema
                and not schema.get("x-kubernetes-preserve-unknown-fields")):
            schema["additionalProperties"] = False
        return schema
    if isinstance(schema, list):
        return [_strict(v) for v in schema]
    return schema


@lru_cache(maxsize=1)
def _graph_validator():
    from openapi_schema_validator import OAS30Validator

    import hashlib

    assert hashlib.sha256(CRD.read_bytes()).hexdigest() == CRD_SHA256  # the operator's, as is
    crd = yaml.load(CRD.read_text(), Loader=LOADER)
    version = next(v for v in crd["spec"]["versions"] if v["name"] == "v1beta1")
    schema = _strict(version["schema"]["openAPIV3Schema"])
    schema["properties"]["metadata"] = {"type": "object"}  # the API server's own, not the CRD's
    return OAS30Validator(schema)


def errors(doc: dict) -> list[str]:
    """What the schemas say is wrong with one object (empty: valid)."""
    if doc.get("kind") == "DynamoGraphDeployment":
        assert doc["apiVersion"] == "nvidia.com/v1beta1"
        return [f"{'/'.join(map(str, e.absolute_path))}: {e.message}"
                for e in _graph_validator().iter_errors(doc)]
    import kubernetes_validate

    try:
        kubernetes_validate.validate(doc, KUBERNETES, strict=True)
    except kubernetes_validate.ValidationError as e:
        return [str(e)]
    return []


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[dict]]:
    return {name: render(K8S / "overlays" / name) for name in OVERLAYS}


def _graph(docs: list[dict]) -> dict:
    (graph,) = [d for d in docs if d["kind"] == "DynamoGraphDeployment"]
    return graph


def _components(docs: list[dict]) -> dict[str, dict]:
    return {c["name"]: c for c in _graph(docs)["spec"]["components"]}


def _main(component: dict) -> dict:
    (main,) = [c for c in component["podTemplate"]["spec"]["containers"] if c["name"] == "main"]
    return main


def test_every_overlay_renders_and_validates(rendered):
    assert {"disagg-llava-7b", "disagg-router-llava-7b"} <= set(rendered)
    for name, docs in rendered.items():
        assert {d["kind"] for d in docs} == {"DynamoGraphDeployment", "PersistentVolumeClaim"}
        for doc in docs:
            assert errors(doc) == [], (name, doc["kind"])


def test_validation_fails_for_a_misspelt_field_and_a_wrong_type(rendered):
    docs = rendered["disagg-router-llava-7b"]
    graph, claim = _graph(docs), next(d for d in docs if d["kind"] == "PersistentVolumeClaim")
    misspelt = copy.deepcopy(graph)
    decode = misspelt["spec"]["components"][2]
    decode["replica"] = decode.pop("replicas")
    assert any("replica" in e for e in errors(misspelt))
    in_pod = copy.deepcopy(graph)
    _main(in_pod["spec"]["components"][1])["readinesProbe"] = {}  # deep in the pod template
    assert any("readinesProbe" in e for e in errors(in_pod))
    wrong_type = copy.deepcopy(graph)
    wrong_type["spec"]["components"][0]["replicas"] = "two"
    assert errors(wrong_type)
    bad_claim = copy.deepcopy(claim)
    bad_claim["spec"]["acessModes"] = bad_claim["spec"].pop("accessModes")
    assert errors(bad_claim)
    bad_claim = copy.deepcopy(claim)
    bad_claim["spec"]["accessModes"] = "ReadOnlyMany"
    assert errors(bad_claim)


def _parser(module: str):
    if module == "frontend":
        from mmhandoff.frontend.app import parser
        return parser()
    if module == "router":
        from mmhandoff.router.router import parser
        return parser()
    from mmhandoff.process.engine_worker import parser
    return parser(module)


def test_every_component_command_exists_and_parses_its_args(rendered):
    seen = set()
    for docs in rendered.values():
        for component in _components(docs).values():
            main = _main(component)
            python, flag, module = main["command"]
            assert (python, flag) == ("python3", "-m") and module.startswith("mmhandoff.")
            seen.add(tuple(main["args"]))
            role = module.split(".", 1)[1]
            _parser(role).parse_args(main["args"])  # exits (fails the test) on a bad flag
    for module in ("frontend", "prefill", "decode", "router"):
        out = subprocess.run([sys.executable, "-m", f"mmhandoff.{module}", "--help"],
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 0 and "usage:" in out.stdout, (module, out.stderr[-500:])
    assert len(seen) > 6  # the overlays changed args, not just the base's


def test_the_router_graph_is_wired_as_serve_wires_it(rendered):
    from mmhandoff.serve.supervisor import load_graph

    wiring = {c.module: c.wiring() for c in load_graph("graphs.disagg_router:Frontend")}
    for name in ("disagg-router-llava-7b", "disagg-router-llava-13b-tp2"):
        components = _components(rendered[name])
        for module, calls in wiring.items():
            args = _main(components[module])["args"]
            for role, endpoint in calls.items():
                assert args[args.index(f"--{role}") + 1] == endpoint, (name, module, role)
        # decode and prefill never share a node: KV crosses the network
        anti = components["decode"]["podTemplate"]["spec"]["affinity"]["podAntiAffinity"]
        selector = anti["requiredDuringSchedulingIgnoredDuringExecution"][0]["labelSelector"]
        assert selector["matchLabels"] == components["prefill"]["podTemplate"]["metadata"][
            "labels"]


def test_tensor_parallel_overlay_asks_for_as_many_gpus_as_ranks(rendered):
    for name, docs in rendered.items():
        for module in ("prefill", "decode"):
            main = _main(_components(docs)[module])
            tp = [a.split("=")[1] for a in main["args"] if a.startswith("tensor_parallel_size=")]
            assert main["resources"]["limits"]["nvidia.com/gpu"] == (tp[-1] if tp else "1"), name


def test_versions_agree_with_pyproject(rendered):
    pyproject = (ROOT / "pyproject.toml").read_text()
    vllm = re.search(r'"vllm==([\d.]+)"', pyproject)[1]
    runtime = re.search(r'"ai-dynamo-runtime==([\d.]+)"', pyproject)[1]
    assert f"vllm/vllm-openai:v{vllm}" in (ROOT / "deploy" / "Dockerfile").read_text()
    for docs in rendered.values():
        for component in _components(docs).values():
            assert component["runtimeVersionOverride"] == runtime


def test_the_tls_overlay_mounts_the_certificates_where_the_runtime_reads_them(rendered):
    """An overlay with the tls component: every component mounts the Secret, and the graph's
    environment is what `serve` gives its components for the YAML's tls (plane.tls), with the
    Secret's file names."""
    from mmhandoff.plane.tls import tls_variables

    with_tls = [name for name, docs in rendered.items()
                if any(e["name"].startswith("DYN_TCP_TLS_") for e in _graph(docs)["spec"]["env"])]
    assert with_tls == ["disagg-router-llava-7b-scale-out"]
    for name in with_tls:
        graph = _graph(rendered[name])
        env = {e["name"]: e.get("value") for e in graph["spec"]["env"]
               if e["name"].startswith("DYN_TCP_TLS_")}
        assert env == tls_variables("/etc/mmhandoff/tls/ca.crt", "/etc/mmhandoff/tls/tls.crt",
                                    "/etc/mmhandoff/tls/tls.key"), name
        for module, component in _components(rendered[name]).items():
            spec = component["podTemplate"]["spec"]
            assert {"name": "tls", "secret": {"secretName": "mmhandoff-tls"}} in spec["volumes"]
            assert {"name": "tls", "mountPath": "/etc/mmhandoff/tls", "readOnly": True} in \
                _main(component)["volumeMounts"], (name, module)
