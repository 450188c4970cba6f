"""Prefill freeing a handoff's blocks that no decode will read (issue 35): a delivery lost with a
crashed frontend or a dead router, revoked at prefill (prefill.claims) first.

vLLM's producer frees a finished request's blocks only on a consumer's notice or at the lease's
end (30 s by default), in its model worker's connector. The worker takes the release here: this
class is mixed into vLLM's worker (`worker_extension_cls`, set for prefill engines by
EngineSpec), and `AsyncLLM.collective_rpc(RELEASE_METHOD, ...)` reaches it between engine steps,
on the thread that reaps leases. The connector (MMHandoffNixlConnector.release_held) ends the
requests' leases now; the next poll frees them as for an expired lease.
"""

from __future__ import annotations

RELEASE_METHOD = "mmhandoff_release_kv"


class HandoffRelease:
    def mmhandoff_release_kv(self, request_ids: list[str]) -> int:
        """End the lease of these finished requests' blocks (vLLM's request ids, as the answer's
        kv_transfer_params name them); how many were still held."""
        from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

        if not has_kv_transfer_group():
            return 0
        release = getattr(get_kv_transfer_group(), "release_held", None)
        return release(request_ids) if release is not None else 0
