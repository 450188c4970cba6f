"""The frontend's Prometheus metrics (served at /metrics). One registry per Frontend, so two
frontends in one process (tests) do not share counts."""

from __future__ import annotations

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

from mmhandoff.wire.messages import DecodeStats

_LATENCY = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
_BYTES = (256, 1024, 4096, 16384, 65536, 262144, 1 << 20, 4 << 20, 16 << 20, 64 << 20)


class FrontendMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter("mmhandoff_requests", "Requests received, by API",
                                ["api"], registry=r)
        self.errors = Counter("mmhandoff_request_errors", "Requests answered with an error, "
                              "by error code", ["code"], registry=r)
        # the answers' usage, as the client got it (vLLM: prompt_tokens / generation_tokens)
        self.prompt_tokens = Counter("mmhandoff_prompt_tokens", "Prompt tokens of the answers "
                                     "sent (their usage)", registry=r)
        self.completion_tokens = Counter("mmhandoff_completion_tokens", "Tokens of the answers "
                                         "sent (their usage)", registry=r)
        self.in_flight = Gauge("mmhandoff_requests_in_flight", "Requests being answered",
                               registry=r)
        self.ttft = Histogram("mmhandoff_time_to_first_token_seconds", "Frontend receipt to "
                              "first token", buckets=_LATENCY, registry=r)
        self.itl = Histogram("mmhandoff_inter_token_latency_seconds", "Time between streamed "
                             "chunks of one answer", buckets=_LATENCY, registry=r)
        self.handoff_bytes = Histogram("mmhandoff_handoff_bytes", "Bytes decode received per "
                                       "request (the media-free handoff)", buckets=_BYTES,
                                       registry=r)
        self.kv_pulled = Counter("mmhandoff_kv_pulled_tokens", "Prompt tokens decode pulled "
                                 "from prefill over NIXL", registry=r)
        self.kv_wait = Histogram("mmhandoff_decode_first_token_seconds", "Decode-side time from "
                                 "admission to its first token (the answer's second when "
                                 "prefill sent the first): the KV pull plus one step",
                                 buckets=_LATENCY, registry=r)
        self.retries = Counter("mmhandoff_retries", "Requests sent through prefill again before "
                               "decode streamed (decode failed closed, a worker was lost)",
                               registry=r)
        self.migrations = Counter("mmhandoff_migrations", "Answers continued on another decode "
                                  "replica after the one streaming them was lost", registry=r)
        self.placement = Histogram("mmhandoff_prefill_placement_seconds", "Time asking the "
                                   "router which prefill replica takes a request (router.place)",
                                   buckets=(0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01,
                                            0.025, 0.1, 1), registry=r)
        self.disconnects = Counter("mmhandoff_client_disconnects", "Streams the client left "
                                   "before the end (the request was aborted)", registry=r)

    def record_decode(self, stats: DecodeStats) -> None:
        if stats.request_bytes < 0:  # no decode: the answer ended at prefill's token
            return
        self.handoff_bytes.observe(stats.request_bytes)
        if stats.kv_tokens_pulled >= 0:
            self.kv_pulled.inc(stats.kv_tokens_pulled)
        self.kv_wait.observe(stats.ttft_ms / 1e3)

    def render(self) -> bytes:
        return generate_latest(self.registry)
