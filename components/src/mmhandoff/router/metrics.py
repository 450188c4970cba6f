"""The router's decisions on its Dynamo system status server (`/metrics` at DYN_SYSTEM_PORT):
what an operator watches to see whether routing finds the KV it should."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily


class _Collector:
    def __init__(self, router, followers: dict) -> None:
        self.router, self.followers = router, followers  # {tier: Follower}

    def collect(self):
        r = self.router
        yield _by_label("mmhandoff_router_decisions", "Handoffs routed, by reason (overlap, "
                        "load, bypass: prefill skipped, round_robin, random, unparsed)",
                        "reason", r.decisions)
        yield _by_label("mmhandoff_router_placements", "Requests placed on a prefill replica, "
                        "by reason (overlap, load, round_robin, random)", "reason", r.placements)
        yield _by_label("mmhandoff_router_hashed", "Handoffs whose block hashes were looked "
                        "up, by who computed them (prefill: carried in the signed handoff; "
                        "router: missing, another block size, or not authentic to the router's "
                        "keys)", "by", r.hashed_by)
        yield GaugeMetricFamily("mmhandoff_router_prefix_keys", "Image prefixes whose engine "
                                "blocks the router knows (learned from handoffs)",
                                value=len(r.table))
        yield GaugeMetricFamily("mmhandoff_router_prefill_index_blocks", "Distinct blocks the "
                                "prefill instances hold", value=len(r.prefill.index))
        yield CounterMetricFamily("mmhandoff_router_blocks", "Full blocks of the routed prompts",
                                  value=r.blocks_total)
        yield CounterMetricFamily("mmhandoff_router_overlap_blocks", "Of those, the blocks the "
                                  "chosen replica held (by the index)", value=r.overlap_total)
        yield CounterMetricFamily("mmhandoff_router_decision_seconds", "Time spent deciding "
                                  "(hashing, lookup, scoring; placements included)",
                                  value=r.decision_s_total)
        yield CounterMetricFamily("mmhandoff_router_lookups", "Prompts prefill asked about "
                                  "(router.held: may its engine be bypassed?)", value=r.lookups)
        yield GaugeMetricFamily("mmhandoff_router_index_blocks", "Distinct blocks in the index",
                                value=len(r.decode.index))
        yield GaugeMetricFamily("mmhandoff_router_index_instances", "Decode instances indexed",
                                value=len(r.decode.index.instances()))
        if self.followers:
            snapshots = CounterMetricFamily("mmhandoff_router_snapshots", "kv_blocks streams "
                                            "(re)started from a worker's snapshot, by tier",
                                            labels=["tier"])
            unsynced = GaugeMetricFamily("mmhandoff_router_instances_unsynced", "Live instances "
                                         "whose blocks the index lacks (a stream starting, or "
                                         "resyncing after a break or falling behind), by tier",
                                         labels=["tier"])
            for tier, follower in sorted(self.followers.items()):
                snapshots.add_metric([tier], follower.snapshots)
                unsynced.add_metric([tier], follower.unsynced())
            yield snapshots
            yield unsynced


def _by_label(name: str, doc: str, label: str, counts) -> CounterMetricFamily:
    family = CounterMetricFamily(name, doc, labels=[label])
    for value, n in sorted(counts.items()):
        family.add_metric([value], n)
    return family


def publish_router_metrics(endpoint, router, followers: dict) -> None:
    """Append the router's metrics to the /metrics of the runtime that serves `endpoint`;
    `followers`: {tier: Follower} (none under policy round_robin)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Collector(router, followers))
    endpoint.metrics.register_prometheus_expfmt_callback(
        lambda: generate_latest(registry).decode())
