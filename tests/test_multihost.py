"""The disagg graph across hosts: etcd and NATS, prefill, decode and the frontend each in a network
namespace of their own (tests/netns.py), KV pulled by NIXL over UCX TCP between them. It answers
as the agg graph on one host does (temperature 0), for a 640x480 and a 12 MP image, with file
discovery + TCP requests and with etcd + NATS; UCX's own protocol report says the KV came over
TCP on the hosts' interface (no shared memory, no CMA). The engines run with NIXL's progress
thread paced as on one host (EngineSpec.nixl_progress_delay_us): the emulated reads still
progress."""

from __future__ import annotations

import signal

import openai
import pytest
import yaml

from benchmarks.kv_pull_bandwidth import _transport
from tests.conftest import data_uri, encode, make_image
from tests.graph_runner import Graph, Servers
from tests.hosted_graph import HostedGraph
from tests.netns import DEVICE, Hosts
from tests.test_graphs import _refused_without_a_certificate
from tests.tls_certs import make_certs

pytestmark = pytest.mark.graph

MODEL = "tiny-llava"
PLACEMENT = {"frontend": "front", "prefill": "prefill", "decode": "decode"}


def _questions() -> dict[str, list[dict]]:
    def ask(text, image):
        return [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": data_uri(encode(image, "JPEG"),
                                                                "image/jpeg")}},
            {"type": "text", "text": text}]}]
    return {"640x480": ask("What is in it?", make_image(640, 480, 181)),
            "12 MP": ask("And in this one?", make_image(4000, 3000, 182))}


def _answers(url: str, questions: dict) -> dict:
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)
    out = {}
    for name, messages in questions.items():
        r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16,
                                           temperature=0, extra_body={"ignore_eos": True})
        out[name] = (r.choices[0].message.content, r.usage.prompt_tokens,
                     r.usage.completion_tokens, r.model_extra["mmhandoff"])
    return out


@pytest.fixture(scope="module")
def questions():
    return _questions()


@pytest.fixture(scope="module")
def agg_answers(tmp_path_factory, questions):
    graph = Graph("graphs.agg:Frontend", "configs/agg.yaml", tmp_path_factory.mktemp("agg"))
    with graph.failing_loudly():
        answers = _answers(graph.url, questions)
        graph.stop(signal.SIGINT)
    return answers


@pytest.fixture
def hosts():
    with Hosts(["infra", "prefill", "decode", "front"]) as h:
        yield h


def _config(**planes) -> dict:
    config = yaml.safe_load(open("configs/disagg.yaml"))
    config.update(planes)
    # decode's UCX says which protocol and transport served each kind of transfer
    config["components"]["decode"]["env"] = {"UCX_PROTO_INFO": "y", "UCX_LOG_LEVEL": "info"}
    return config


def _check(graph: HostedGraph, hosts: Hosts, questions: dict, agg: dict) -> None:
    got = hosts.call("front", _answers, graph.frontend_url(), questions)
    for name in questions:
        assert got[name][:3] == agg[name][:3], name
        stats = got[name][3]
        assert stats["kv_tokens_pulled"] > 0, (name, stats)  # the prompt's KV came from prefill
        assert stats["request_bytes"] < 20_000, (name, stats)  # and no media with it
    transport = _transport(graph.lines("decode"), "READ")
    rows = transport.split("; ")
    assert rows and all(row.endswith(f"tcp/{DEVICE}") for row in rows), transport


def _etcd_refuses_without_a_certificate(servers: Servers, hosts: Hosts, certs: dict) -> None:
    """From the client's host: etcd answers a client with the graph's certificate and refuses
    one that only trusts the CA."""
    import subprocess

    def get(*identity: str) -> subprocess.CompletedProcess:
        argv = [servers.etcdctl, "--endpoints", servers.etcd_url, "--cacert", certs["ca"],
                *identity, "--command-timeout", "5s", "get", "--prefix", "--keys-only", ""]
        return subprocess.run(hosts.command("front", argv), capture_output=True, text=True,
                               timeout=60)

    ok = get("--cert", certs["cert"], "--key", certs["key"])
    assert ok.returncode == 0 and ok.stdout.strip(), ok.stderr[-2000:]  # the graph's keys
    refused = get()
    assert refused.returncode != 0, refused.stdout[-2000:]


@pytest.mark.parametrize("planes", ["files+tcp", "etcd+nats", "files+tcp+tls", "etcd+nats+tls"])
def test_disagg_across_hosts_answers_as_agg(tmp_path, hosts, questions, agg_answers, planes):
    """With `tls` (issue 35): the request plane between the hosts is mutual TLS (the YAML's
    certificates, naming the hosts' addresses), and etcd and NATS, where the graph uses them,
    serve TLS and require client certificates; the graph answers as agg, and a caller on the
    client's host that trusts the CA but has no certificate of its own reaches no endpoint."""
    # NATS carries each image to prefill in the request: its max_payload (1 MiB by default)
    # raised to NATS' largest, as docs/deploy.md asks of a deployment
    certs = None
    if planes.endswith("+tls"):
        certs = make_certs(tmp_path / "certs", ips=tuple(hosts.ip(h) for h in hosts.names))
    servers = (Servers(tmp_path, hosts, "infra", nats_max_payload=64 * 2**20, tls=certs)
               if planes.startswith("etcd+nats") else None)
    try:
        config = _config(etcd=servers.etcd_url, nats=servers.nats_url) if servers else _config()
        if certs:
            config["tls"] = certs
        with HostedGraph("graphs.disagg:Frontend", config, hosts, PLACEMENT,
                         client="front") as graph:
            try:
                _check(graph, hosts, questions, agg_answers)
                if servers and certs:
                    _etcd_refuses_without_a_certificate(servers, hosts, certs)
                elif certs:
                    _refused_without_a_certificate(
                        graph, certs, (config.get("namespace", "mmhandoff"),
                                       str(graph.run_dir / "discovery")),
                        lambda argv, env: (hosts.command("front", argv),
                                           {**env, **hosts.env("front")}))
            except BaseException:
                print("".join(graph.log[-150:]))
                raise
    finally:
        if servers:
            servers.close()
