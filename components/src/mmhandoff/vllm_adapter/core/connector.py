"""NixlConnector whose NIXL progress thread sleeps between polls instead of spinning, and which
leaves the model's compute thread on the cores the engine was given.

NIXL's Python agent starts a progress thread with `pthrDelay = 0` hard-coded (nixl/_api.py): it
polls UCX back to back and burns a whole core per engine, idle or not (measured: 1.0 core; with
a 100 us delay: 0.03). On a 2-core machine two such engines left the model no core and every
request got ~15x slower. vLLM exposes neither setting. The thread itself must stay: an idle
engine still has to progress UCX (wire-up, notifications, reads emulated over TCP), or a peer's
transfer stalls until the engine happens to step.

This subclass builds the agent with the delay from `kv_connector_extra_config
["progress_delay_us"]` (0 keeps NIXL's spin) by handing NIXL a subclass of its own config type
for the duration of the connector's construction.

On CPU, vLLM's NIXL worker (nixl/base_worker.py, "reserve different cores for start_load_kv()")
calls `os.sched_setaffinity(0, <last core of each NUMA node>)` from the thread that builds it,
which is the model's compute thread (the OpenMP master). Every engine's model then runs on the
machine's last core whatever VLLM_CPU_OMP_THREADS_BIND says: on 2 cores, prefill and decode
shared core 1 and the graph's TTFT was ~10x the in-process one. The worker-side connector here
puts the thread's affinity back once vLLM's constructor returns.

Two scheduler-side changes serve the first-token contract (the answer's first token comes from
prefill, decode continues after it; wire/handoff.py):
- Decode's prompt is prefill's plus that token, one token longer than the KV prefill holds.
  vLLM counts the whole prompt as external ("pull all prompt blocks") and would allocate a block
  more than prefill names when prefill's prompt fills its last block exactly. With
  PULLED_TOKENS_KEY in the request's kv_transfer_params, only that many tokens are external; the
  engine computes the first token's position itself and samples the second.
- A prefill whose one token stopped the answer (EOS, a stop token) holds its blocks for a pull
  that will never come (vLLM keeps stopped requests' blocks too). With RELEASE_ON_STOP_KEY the
  blocks are freed at once, as for an aborted request, and the output names no blocks.

And one worker-side change: `release_held` ends the lease of finished requests whose handoff
nobody will claim (core.release).
"""

from __future__ import annotations

import contextlib
import os
import sys

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.nixl import NixlConnector
from vllm.distributed.nixl_utils import NixlWrapper
from vllm.v1.request import RequestStatus

from mmhandoff.engine import RELEASE_ON_STOP_KEY
from mmhandoff.vllm_adapter.inputs import PULLED_TOKENS_KEY


@contextlib.contextmanager
def progress_delay(delay_us: int):
    """While active, NIXL agents are created with a progress-thread poll delay of `delay_us`."""
    bind = sys.modules[NixlWrapper.__module__].nixlBind
    original = bind.nixlAgentConfig

    class _DelayedConfig(original):
        def __setattr__(self, name, value):
            if name == "pthrDelay" and value == 0:
                value = delay_us
            super().__setattr__(name, value)

    bind.nixlAgentConfig = _DelayedConfig
    try:
        yield
    finally:
        bind.nixlAgentConfig = original


class MMHandoffNixlConnector(NixlConnector):
    def __init__(self, vllm_config, role, *args, **kwargs) -> None:
        extra = vllm_config.kv_transfer_config.kv_connector_extra_config or {}
        delay_us = int(extra.get("progress_delay_us", 0))
        worker = role == KVConnectorRole.WORKER
        affinity = os.sched_getaffinity(0) if worker else None
        with progress_delay(delay_us) if worker and delay_us > 0 else contextlib.nullcontext():
            super().__init__(vllm_config, role, *args, **kwargs)
        if affinity is not None and os.sched_getaffinity(0) != affinity:
            os.sched_setaffinity(0, affinity)

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int):
        params = request.kv_transfer_params or {}
        pulled = params.get(PULLED_TOKENS_KEY)
        if pulled is None or not params.get("do_remote_prefill"):
            return super().get_num_new_matched_tokens(request, num_computed_tokens)
        count = int(pulled) - num_computed_tokens
        # nothing left to pull (all in the local prefix cache): vLLM's own full-hit path, which
        # still tells prefill to free its blocks
        return (count, True) if count > 0 else (0, False)

    def release_held(self, request_ids: list[str]) -> int:
        """Worker side: the leases of these requests' blocks end now (those still held; a pull
        done or a lease ended meanwhile is not), and the connector's next poll frees them as it
        frees an expired lease. vLLM 0.26 reaps leases in insertion order and stops at the first
        unexpired one, so the ended ones are moved to the front (0.31 scans them all)."""
        worker = self.connector_worker
        if worker is None:
            return 0
        held = worker._reqs_to_send  # {request id: lease end, time.perf_counter()}
        ended = [r for r in dict.fromkeys(request_ids) if r in held]
        if ended:
            rest = [(r, t) for r, t in held.items() if r not in set(ended)]
            held.clear()  # in place: the worker holds this dict
            held.update(dict.fromkeys(ended, 0.0))
            held.update(rest)
        return len(ended)

    def request_finished(self, request, block_ids):
        with _released_if_stopped(request):
            return super().request_finished(request, block_ids)

    def request_finished_all_groups(self, request, block_ids):
        with _released_if_stopped(request):
            return super().request_finished_all_groups(request, block_ids)


@contextlib.contextmanager
def _released_if_stopped(request):
    """A prefill request whose token ended the answer: vLLM's connector sees it as aborted (frees
    its blocks now, hands no blocks out) while it decides."""
    params = request.kv_transfer_params or {}
    if not (params.get(RELEASE_ON_STOP_KEY) and params.get("do_remote_decode")
            and request.status == RequestStatus.FINISHED_STOPPED):
        yield
        return
    request.status = RequestStatus.FINISHED_ABORTED
    try:
        yield
    finally:
        request.status = RequestStatus.FINISHED_STOPPED
