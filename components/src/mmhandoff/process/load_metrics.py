"""A worker's engine load on its Dynamo system status server (`/metrics` at DYN_SYSTEM_PORT,
next to `/health`): the share of KV cache blocks that requests hold, and the requests running
and waiting, as of the engine's last step, and the requests it finished (an EngineLoad). What an
operator watches; what the graph tests read to check that no KV is held once every request has
ended, and that a bypassed request never reached prefill's engine."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily


class _Collector:
    def __init__(self, load) -> None:
        self.load = load

    def collect(self):
        load = self.load
        yield GaugeMetricFamily(
            "mmhandoff_engine_kv_cache_usage", "Share of the engine's KV cache blocks held by "
            "requests, 0 to 1 (prefix-cached blocks no request holds count as free; prefill's "
            "blocks wait for decode's pull)", value=load.kv_cache_usage)
        yield GaugeMetricFamily("mmhandoff_engine_requests_running", "Requests the engine "
                                "schedules", value=load.num_running)
        yield GaugeMetricFamily("mmhandoff_engine_requests_waiting", "Requests queued for the "
                                "engine (a decode request pulling its KV included)",
                                value=load.num_waiting)
        yield CounterMetricFamily("mmhandoff_engine_requests_finished", "Requests the engine "
                                  "finished (answered, stopped, aborted or failed)",
                                  value=load.requests_finished)


def publish_engine_load(endpoint, load) -> None:
    """Append `load`'s gauges to the /metrics of the Dynamo runtime that serves `endpoint`."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Collector(load))
    endpoint.metrics.register_prometheus_expfmt_callback(
        lambda: generate_latest(registry).decode())
