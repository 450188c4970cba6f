"""The decode engine's fail-closed scheduler (loaded by vLLM through `scheduler_cls`).

A KV-only request carries image features without media (no data; an M-RoPE model's: the
image's grid alone): its image spans can only come from KV
(pulled from prefill, or already in the local prefix cache). Whenever vLLM would compute a token
of such a request below the end of its last image span (first schedule with nothing loaded, after
preemption dropped its blocks, after a failed or partial KV load), this scheduler ends the request
with FINISHED_ERROR and a `stop_reason` naming the cause, instead of letting vLLM schedule the
encoder with no data (which kills the engine core with "Encoder cache miss").

vLLM asks `_try_schedule_encoder_inputs` exactly when a request with media would compute tokens,
in the running and the waiting loop alike, so one narrow override sees every such moment. The
request is not scheduled in that step (zero new tokens, vLLM's own "cannot schedule" path) and is
finished at the end of the step, where vLLM finishes its other errored requests.

`KvStatsScheduler`, its base, is also the full-media decode engine's scheduler: every engine that
pulls KV reports, in a request's last output, how many of its prompt tokens were pulled, so that
the handoff and the full-media request can be compared on what they really pulled.
"""

from __future__ import annotations

from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs
from vllm.v1.request import Request, RequestStatus

from mmhandoff.vllm_adapter.positions import is_kv_only

# The decode worker recognises errors from this scheduler by this prefix of `stop_reason`.
KV_COVERAGE_STOP_REASON = "mmhandoff.kv_coverage:"
# Key in the final output's kv_transfer_params under which the scheduler reports where a KV-only
# request's prompt came from: {"local": tokens from the local prefix cache, "external": pulled}.
KV_STATS_KEY = "mmhandoff_kv"


def kv_required_until(request: Request) -> int:
    """One past the last prompt position that must come from KV (0: nothing must)."""
    return max(
        (f.mm_position.offset + f.mm_position.length for f in request.mm_features or ()
         if is_kv_only(f)),
        default=0,
    )


def coverage_cause(request: Request, num_computed_tokens: int, required: int) -> str:
    if request.num_preemptions > 0:
        return (f"preempted: image KV below position {required} was dropped and cannot be "
                f"recomputed on decode ({num_computed_tokens} positions still cached)")
    if num_computed_tokens == 0:
        return f"no KV: nothing was loaded for the image spans below position {required}"
    return (f"partial KV: {num_computed_tokens} positions loaded or cached, image spans need "
            f"{required}")


class KvStatsScheduler(Scheduler):
    """Puts {"covered", "local", "external"} (KV_STATS_KEY) in the last output of each request
    with media: its prompt tokens already computed, from the local prefix cache and pulled, as
    vLLM counted them when it first scheduled the request's computation."""

    def __new__(cls, *args, **kwargs):
        # vLLM turns async scheduling on by default (the next step is scheduled while the GPU
        # runs this one) and does not ask whether a `scheduler_cls` can do it: a subclass of the
        # plain Scheduler then schedules each request every other step (decode's inter-token
        # time). Under async scheduling the engine gets the same class over AsyncScheduler.
        config = kwargs.get("vllm_config", args[0] if args else None)
        if (config is not None and config.scheduler_config.async_scheduling
                and not issubclass(cls, AsyncScheduler)):
            cls = ASYNC_VARIANT[cls]
        return super().__new__(cls)

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._kv_stats: dict[str, dict[str, int]] = {}

    def _try_schedule_encoder_inputs(
        self, request, num_computed_tokens, num_new_tokens, encoder_compute_budget,
        *args, **kwargs,
    ):
        if num_new_tokens > 0 and request.request_id not in self._kv_stats:
            stats = request.prefill_stats
            self._kv_stats[request.request_id] = {
                "covered": num_computed_tokens,
                "local": stats.num_local_cached_tokens if stats else -1,
                "external": stats.num_external_cached_tokens if stats else -1,
            }
        return super()._try_schedule_encoder_inputs(
            request, num_computed_tokens, num_new_tokens, encoder_compute_budget,
            *args, **kwargs,
        )

    def update_from_output(self, scheduler_output, model_runner_output):
        outputs = super().update_from_output(scheduler_output, model_runner_output)
        if self._kv_stats:
            for eco in outputs.values():
                for output in eco.outputs:
                    if output.finish_reason is not None and output.request_id in self._kv_stats:
                        stats = self._kv_stats.pop(output.request_id)
                        output.kv_transfer_params = {**(output.kv_transfer_params or {}),
                                                     KV_STATS_KEY: stats}
        return outputs

    def finish_requests(self, request_ids, finished_status):
        finished = super().finish_requests(request_ids, finished_status)
        for request in finished:  # aborted or failed: no output will carry the stats
            self._kv_stats.pop(request.request_id, None)
        return finished


class FailClosedScheduler(KvStatsScheduler):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._kv_coverage_failures: dict[str, str] = {}

    def _try_schedule_encoder_inputs(
        self, request, num_computed_tokens, num_new_tokens, encoder_compute_budget,
        *args, **kwargs,
    ):
        required = kv_required_until(request)
        if num_new_tokens > 0 and num_computed_tokens < required:
            self._kv_coverage_failures.setdefault(
                request.request_id, coverage_cause(request, num_computed_tokens, required)
            )
            # vLLM answers "nothing to schedule" in its own return shape (and no stats)
            num_new_tokens = 0
        return super()._try_schedule_encoder_inputs(
            request, num_computed_tokens, num_new_tokens, encoder_compute_budget,
            *args, **kwargs,
        )

    def update_from_output(self, scheduler_output, model_runner_output):
        failed = []
        if self._kv_coverage_failures:
            causes, self._kv_coverage_failures = self._kv_coverage_failures, {}
            for request in self.finish_requests(causes, RequestStatus.FINISHED_ERROR):
                failed.append((request.client_index, EngineCoreOutput(
                    request_id=request.request_id,
                    new_token_ids=[],
                    finish_reason=request.get_finished_reason(),
                    stop_reason=f"{KV_COVERAGE_STOP_REASON} {causes[request.request_id]}",
                    events=request.take_events(),
                    trace_headers=request.trace_headers,
                )))
        outputs = super().update_from_output(scheduler_output, model_runner_output)
        for client_index, output in failed:
            outputs.setdefault(client_index, EngineCoreOutputs()).outputs.append(output)
        return outputs


# The same schedulers over vLLM's AsyncScheduler (MRO: ours, then AsyncScheduler, then
# Scheduler), chosen by KvStatsScheduler.__new__ when the engine schedules asynchronously.
class AsyncKvStatsScheduler(KvStatsScheduler, AsyncScheduler):
    pass


class AsyncFailClosedScheduler(FailClosedScheduler, AsyncScheduler):
    pass


ASYNC_VARIANT = {KvStatsScheduler: AsyncKvStatsScheduler,
                 FailClosedScheduler: AsyncFailClosedScheduler}
