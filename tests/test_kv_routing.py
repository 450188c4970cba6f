"""The KV-aware router on the served graph (disagg_router: two prefill, two decode replicas).

A seeded multi-turn trace in which every image comes back (a second conversation about it, and
follow-up turns): for each request whose image was seen before, how much of the image's KV the
chosen prefill replica and the chosen decode replica already held, read from the engines' own
counters (each answer's `mmhandoff.prefill.cached_tokens` and `mmhandoff.kv_tokens_local`:
vLLM's count of prompt tokens found in that engine's prefix cache), for the KV policy against
round robin in the same test. The answers of both runs must be equal (the
route changes where KV comes from, never the answer). Mid-trace the router is killed (-9): serve
restarts it (one of two router replicas), it rebuilds its index from the workers' snapshots, and
the hit rate holds. The KV run uses etcd for discovery and NATS for requests (real servers): the
workers' kv_blocks streams cross NATS; the routers look up the block hashes prefill carries in
each handoff (signed: serve gives every process of a graph run one key). The round-robin run
uses the one-host defaults.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from benchmarks.kv_routing_trace import IMAGES, next_turn
from benchmarks.kv_routing_trace import trace as _trace
from tests.conftest import data_uri, encode, make_image
from tests.graph_runner import Graph, Servers
from tests.test_graphs import (
    MODEL,
    _client,
    _disagg_router,
    _metric,
    _restarted,
    _router_metrics,
)

pytestmark = pytest.mark.graph

BLOCK = 32  # the engines' KV block size (EngineSpec's default; the YAML's router agrees)
SIZE = (64, 48)


@pytest.fixture(scope="module")
def image_tokens(tiny_model) -> int:
    """The prompt tokens up to the last full block that ends inside the image span, computed
    independently of mmhandoff (transformers' processor and chat template): the part of a
    repeated image's KV any replica could have cached, whatever question follows it."""
    from PIL import Image
    from transformers import AutoProcessor

    proc = AutoProcessor.from_pretrained(tiny_model)
    text = proc.apply_chat_template([{"role": "user", "content": [
        {"type": "image"}, {"type": "text", "text": "Question 0?"}]}], add_generation_prompt=True)
    ids = proc(text=text, images=[Image.new("RGB", SIZE)])["input_ids"][0]
    image_id = proc.tokenizer.convert_tokens_to_ids("<image>")
    end = max(i for i, t in enumerate(list(ids)) if t == image_id) + 1
    assert end >= BLOCK
    return end // BLOCK * BLOCK


def _run(graph: Graph, trace, kill_router_at: int | None = None):
    """Answers (in trace order) and, for each request about an image seen before, the share of
    the image's cacheable tokens found on the chosen replica."""
    client = _client(graph.url)
    uris = [data_uri(encode(make_image(*SIZE, 500 + i))) for i in range(IMAGES)]
    history: dict[int, list[dict]] = {}
    seen: set[int] = set()
    answers, found = [], []
    for n, (c, turn) in enumerate(trace):
        if n == kill_router_at:
            graph.kill_replica("router-0")
            _restarted(graph, "router-0")
        r = client.chat.completions.create(
            model=MODEL, messages=next_turn(history, c, turn, uris), max_tokens=8,
            temperature=0, extra_body={"ignore_eos": True})
        text = r.choices[0].message.content
        history[c].append({"role": "assistant", "content": text})
        answers.append(text)
        stats = r.model_extra["mmhandoff"]
        if c % IMAGES in seen:
            found.append((n, stats["kv_tokens_local"], stats["prefill"]["cached_tokens"]))
        seen.add(c % IMAGES)
    return answers, found


def test_kv_routing_finds_repeated_images_on_the_chosen_replica(tmp_path, image_tokens):
    trace = _trace(13)
    half = len(trace) // 2
    results, metrics, asks = {}, {}, {}
    servers = Servers(tmp_path)
    try:
        for policy in ("round_robin", "kv"):
            # the bypass off: every request reaches both tiers, so both are measured
            config, planes = _disagg_router(tmp_path, policy, prefills=2, bypass=False), {}
            if policy == "kv":  # two routers: the graph answers while one is killed, restarted;
                spec = yaml.safe_load(Path(config).read_text())  # the kv_blocks streams go
                spec["components"]["router"]["replicas"] = 2  # over NATS, discovery is etcd
                Path(config).write_text(yaml.safe_dump(spec))
                planes = dict(etcd=servers.etcd_url, nats=servers.nats_url, namespace="mmh-kv")
            graph = Graph("graphs.disagg_router:Frontend", config, tmp_path, **planes)
            with graph.failing_loudly():
                results[policy] = _run(graph, trace,
                                       kill_router_at=half if policy == "kv" else None)
                metrics[policy] = _router_metrics(graph)
                # the frontend's asks to router.place: one per request (two prefill replicas)
                asks[policy] = [_metric(graph.url, f"mmhandoff_prefill_placement_seconds_{s}")
                                for s in ("count", "sum")]
                graph.stop()
    finally:
        servers.close()
    rr_answers, rr_found = results["round_robin"]
    kv_answers, kv_found = results["kv"]
    assert kv_answers == rr_answers

    def rate(found, tier):  # tier 1: decode's count, 2: prefill's
        return sum(min(f[tier], image_tokens) for f in found) / (image_tokens * len(found))

    after_restart = [f for f in kv_found if f[0] > half]
    for name, tier in (("decode", 1), ("prefill", 2)):
        print(f"repeated-image KV found on the chosen {name} replica: kv "
              f"{rate(kv_found, tier):.0%} ({rate(after_restart, tier):.0%} after the router's "
              f"restart), round robin {rate(rr_found, tier):.0%}; {len(kv_found)} requests")
    for policy, (n, took) in asks.items():
        assert n == len(trace), (policy, n)
        print(f"router.place, asked by the frontend ({policy}): {took / n * 1e3:.2f} ms mean")
    assert len(kv_found) == len(rr_found) >= 12
    for tier in (1, 2):
        assert rate(kv_found, tier) >= 0.9 and rate(after_restart, tier) >= 0.9
        assert rate(rr_found, tier) <= 0.75
    # the routers' own account (/metrics): every decode instance indexed by each router, and
    # decisions and placements by overlap; round robin decides nothing itself
    kv, rr = metrics["kv"], metrics["round_robin"]
    assert kv['mmhandoff_router_index_instances'] == 2 * 2  # two routers, two decode each
    for tier in ("decode", "prefill"):  # every live instance's blocks in each router's index
        assert kv[f'mmhandoff_router_instances_unsynced{{tier="{tier}"}}'] == 0
    assert kv['mmhandoff_router_decisions_total{reason="overlap"}'] >= 1
    # each handoff's hashes were prefill's, verified: no router hashed a prompt itself
    decided = sum(n for k, n in kv.items() if k.startswith("mmhandoff_router_decisions_total"))
    assert kv['mmhandoff_router_hashed_total{by="prefill"}'] == decided > 0, kv
    assert kv['mmhandoff_router_hashed_total{by="router"}'] == 0
    assert kv['mmhandoff_router_placements_total{reason="overlap"}'] >= 1
    assert kv["mmhandoff_router_prefix_keys"] >= 2  # each router's table: the prefill streams'
    assert rr['mmhandoff_router_placements_total{reason="round_robin"}'] == len(trace)
    assert 0 < kv["mmhandoff_router_overlap_blocks_total"] <= kv["mmhandoff_router_blocks_total"]
    assert rr['mmhandoff_router_decisions_total{reason="round_robin"}'] == len(trace)
