"""On a GPU host only: `mmhandoff serve` with the shipped GPU configs (configs/gpu/), as a user
starts them, no engine argument passed by hand: each graph starts on the GPUs the host has (on
one GPU its engines share it, started one after another), answers streaming and not, and the
agg and disagg graphs give the same greedy answer. The `gpu` tier (docs/gpu.md):

    scripts/gpu/device.sh run python3 -m pytest -q -m gpu tests/test_gpu_served.py
"""

from __future__ import annotations

import json
import re
import urllib.request

import pytest

from tests.conftest import data_uri, encode, make_image
from tests.graph_runner import Graph

pytestmark = pytest.mark.gpu

IMAGE = data_uri(encode(make_image(640, 480, 5), "JPEG"), "image/jpeg")


def _ask(url: str, model: str, stream: bool) -> str:
    body = {"model": model, "max_tokens": 16, "temperature": 0, "ignore_eos": True,
            "stream": stream, "messages": [{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": IMAGE}},
                {"type": "text", "text": "Describe the picture."}]}]}
    request = urllib.request.Request(url + "/v1/chat/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=300) as r:
        assert r.status == 200
        if not stream:
            answer = json.loads(r.read())
            assert answer["usage"]["completion_tokens"] == 16, answer
            return answer["choices"][0]["message"]["content"]
        text, done = "", False
        for line in r:
            line = line.decode().strip()
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: "):
                chunk = json.loads(line[6:])
                assert "error" not in chunk, chunk
                text += "".join(c["delta"].get("content") or "" for c in chunk["choices"])
        assert done, "the stream did not end with [DONE]"
        return text


def _served(tmp_path, graph: str, model: str, *, text: bool = True) -> tuple[str, list[str]]:
    """`text`: the answer has text. With dummy weights a shape's greedy tokens may all lie past
    the tiny tokenizer's 512 tokens (the shapes keep the real vocabulary size), which decode to
    nothing: TinyLLaVA's did on an H100, 16 tokens and no text."""
    g = Graph(f"graphs.{graph}:Frontend", f"configs/gpu/{graph}.yaml", tmp_path, ready_s=900)
    with g.failing_loudly():
        plain, streamed = _ask(g.url, model, False), _ask(g.url, model, True)
        assert plain == streamed and (plain or not text), (plain, streamed)
        placed = [line.strip() for line in g.log if re.search(r"\[serve\] \w+-\d+: GPU", line)]
        starts = [line.strip() for line in g.log if "engine started in" in line]
        print(f"{graph}: {placed} {starts}", flush=True)
        g.stop()
    return plain, placed


@pytest.fixture(scope="module")
def answers(tmp_path_factory):
    return {graph: _served(tmp_path_factory.mktemp(graph), graph, "llava-1.5-7b")
            for graph in ("agg", "disagg")}


def test_agg_and_disagg_answer_alike_with_the_shipped_gpu_configs(answers):
    assert answers["agg"][0] == answers["disagg"][0]
    # every engine replica was placed on a GPU
    assert len(answers["agg"][1]) == 1 and len(answers["disagg"][1]) == 2


def test_disagg_router_starts_and_answers_with_four_engines(tmp_path):
    _, placed = _served(tmp_path, "disagg_router", "tinyllava-1.1b", text=False)
    assert len(placed) == 4
