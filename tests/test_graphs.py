"""The graphs as users run them: `mmhandoff serve` on one host, driven by the official openai
client. The disagg graph answers exactly as the agg graph does (temperature 0), with file
discovery + TCP and with real etcd + NATS; Ctrl-C, SIGTERM and a crashed component all end with
no process left."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import urllib.request

import openai
import pytest

from tests.conftest import data_uri, encode, make_image
from tests.graph_runner import Graph, Servers

pytestmark = pytest.mark.graph

MODEL = "tiny-llava"
ALLOW_LOOPBACK_IMAGES = ["--allow-image-networks", "127.0.0.0/8"]  # the test image server


def _questions(image_server: str) -> dict[str, list[dict]]:
    def ask(text, *urls):
        return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": u}}
                                             for u in urls] + [{"type": "text", "text": text}]}]
    return {
        "data URI": ask("What is in it?", data_uri(encode(make_image(200, 150, 91)))),
        "http URL": ask("And this one?", image_server + "/img.png"),
        "two images": ask("Compare them.", data_uri(encode(make_image(160, 120, 92))),
                          data_uri(encode(make_image(96, 128, 93), "JPEG"), "image/jpeg")),
        "text only": [{"role": "user", "content": "No picture today."}],
    }


def _answers(url: str, questions: dict) -> dict:
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)
    assert [m.id for m in client.models.list().data] == [MODEL]
    out = {}
    for name, messages in questions.items():
        plain = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10,
                                               temperature=0, extra_body={"ignore_eos": True})
        streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=10, temperature=0, stream=True,
            extra_body={"ignore_eos": True}) if c.choices)
        assert plain.choices[0].message.content == streamed, name
        out[name] = (streamed, plain.usage.prompt_tokens, plain.usage.completion_tokens,
                     plain.model_extra["mmhandoff"])
    return out


@pytest.fixture(scope="module")
def agg_answers(tmp_path_factory, image_server):
    """The reference: the agg graph (one engine, no handoff); stopped with Ctrl-C."""
    graph = Graph("graphs.agg:Frontend", "configs/agg.yaml", tmp_path_factory.mktemp("agg"),
                  frontend_args=ALLOW_LOOPBACK_IMAGES)
    with graph.failing_loudly():
        answers = _answers(graph.url, _questions(image_server))
        graph.stop(signal.SIGINT, times=3)  # Ctrl-C, pressed again while it stops
    assert all(stats["request_bytes"] == 0 for *_, stats in answers.values())
    return answers


def _check_equal_to_agg(got: dict, agg: dict) -> None:
    for name, (text, prompt_tokens, completion_tokens, stats) in got.items():
        assert (text, prompt_tokens, completion_tokens) == agg[name][:3], name
        assert completion_tokens == 10
        assert 0 < stats["request_bytes"] < 4096  # the handoff, never the media
        if name != "text only":  # KV origin is reported for image requests
            assert stats["kv_tokens_pulled"] > 0 or stats["kv_tokens_local"] > 0, (name, stats)


def _stop_mid_answer(graph: Graph, messages: list[dict], max_tokens: int = 400) -> None:
    """SIGTERM to serve while a streamed answer is under way: the answer still ends whole (the
    frontend drains before the workers stop), then serve exits 0 and leaves nothing."""
    client = openai.OpenAI(base_url=graph.url + "/v1", api_key="none", max_retries=0, timeout=120)
    stream = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=max_tokens, temperature=0, stream=True,
        extra_body={"ignore_eos": True})
    chunks = iter(stream)
    first = next(chunks)
    assert first.choices[0].finish_reason is None  # under way when the signal goes
    graph.proc.send_signal(signal.SIGTERM)
    rest = list(chunks)
    finals = [c for c in rest if c.choices and c.choices[0].finish_reason]
    assert [c.choices[0].finish_reason for c in finals] == ["length"]
    assert finals[0].usage.completion_tokens == max_tokens
    graph.wait(expect=0)
    assert any("[serve] stopped" in line for line in graph.log)


def test_disagg_graph_answers_as_agg(tmp_path, image_server, agg_answers):
    graph = Graph("graphs.disagg:Frontend", "configs/disagg.yaml", tmp_path,
                  frontend_args=ALLOW_LOOPBACK_IMAGES)
    with graph.failing_loudly():
        questions = _questions(image_server)
        _check_equal_to_agg(_answers(graph.url, questions), agg_answers)
        assert any(line.startswith("[decode-0]") for line in graph.log)
        health = graph.health_urls()  # every replica reports ready (workers: Dynamo's server)
        assert sorted(health) == ["decode-0", "frontend-0", "prefill-0"]
        for url in health.values():
            with urllib.request.urlopen(url, timeout=10) as r:
                assert r.status == 200, url
        _stop_mid_answer(graph, questions["data URI"])


@pytest.mark.parametrize("target, config, replicas", [
    ("graphs.disagg_router:Frontend", "configs/disagg_router.yaml",
     ["decode-0", "decode-1", "frontend-0", "prefill-0", "router-0"]),
    ("graphs.full_media:Frontend", "configs/full_media.yaml", ["decode-0", "frontend-0",
                                                              "prefill-0"]),
])
def test_router_and_full_media_graphs_answer_as_agg(tmp_path, image_server, agg_answers, target,
                                                    config, replicas):
    graph = Graph(target, config, tmp_path, frontend_args=ALLOW_LOOPBACK_IMAGES)
    with graph.failing_loudly():
        assert sorted(graph.health_urls()) == replicas
        got = _answers(graph.url, _questions(image_server))
        for name, (text, prompt_tokens, completion_tokens, stats) in got.items():
            assert (text, prompt_tokens, completion_tokens) == agg_answers[name][:3], name
            if "full_media" in target and name != "text only":  # decode got the image again
                assert stats["request_bytes"] > 4096, (name, stats)
            else:
                assert 0 < stats["request_bytes"] < 4096, (name, stats)
        graph.stop()


def test_disagg_graph_on_etcd_and_nats_then_a_crash(tmp_path, image_server, agg_answers):
    servers = Servers(tmp_path)
    try:
        graph = Graph("graphs.disagg:Frontend", "configs/disagg.yaml", tmp_path,
                      frontend_args=ALLOW_LOOPBACK_IMAGES, etcd=servers.etcd_url,
                      nats=servers.nats_url, namespace="mmh-etcd")
        with graph.failing_loudly():
            _check_equal_to_agg(_answers(graph.url, _questions(image_server)), agg_answers)
            # the components really registered in etcd and talk through NATS
            keys = subprocess.run([servers.etcdctl, "--endpoints", servers.etcd_url, "get",
                                   "--prefix", "", "--keys-only"], capture_output=True,
                                  text=True, check=True).stdout
            assert "mmh-etcd" in keys, keys
            with urllib.request.urlopen(servers.nats_monitor + "/connz", timeout=10) as r:
                assert json.loads(r.read())["num_connections"] >= 3
            # a component dies: serve names it, stops the rest, exits 1, leaves nothing
            os.kill(graph.pid_of("decode"), signal.SIGKILL)
            graph.wait(expect=1)
            assert any("component died: decode-0" in line for line in graph.log), \
                graph.tail()
    finally:
        servers.close()


def test_ctrl_c_while_the_graph_starts(tmp_path):
    """Ctrl-C before the graph is ready stops it at once (serve does not wait out the start-up),
    exit 0, and nothing it started is left, engine cores in the middle of starting included."""
    graph = Graph("graphs.disagg:Frontend", "configs/disagg.yaml", tmp_path, wait_ready=False)
    with graph.failing_loudly():
        deadline = time.monotonic() + 60
        while len(graph.replica_pids()) < 3 and time.monotonic() < deadline:
            time.sleep(0.05)  # polls serve's own announcement, bounded
        assert len(graph.replica_pids()) == 3, graph.tail()
        graph.stop(signal.SIGINT, expect=0)
        assert not any("[serve] ready" in line for line in graph.log)
        assert any("[serve] stopped" in line for line in graph.log)
