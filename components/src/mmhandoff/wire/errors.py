"""The typed errors of handoff admission: one type per rule, each with a stable `code` that is
safe to show to a client (mmhandoff.wire.handoff raises them; the frontend maps them to its
answers)."""

from __future__ import annotations


class HandoffError(ValueError):
    """A handoff the decode tier refuses. `code` is stable and safe to show to a client."""

    code = "invalid_handoff"
    # The client never sends a handoff: prefill made it, so a refused one is our fault.
    fault = "server"


class MalformedHandoff(HandoffError):
    code = "malformed"


class UnsupportedVersion(HandoffError):
    code = "unsupported_version"


class PayloadPresent(HandoffError):
    code = "payload_present"


class EmptyHash(HandoffError):
    code = "empty_hash"


class FeatureMismatch(HandoffError):
    code = "feature_mismatch"


class SpanOutOfRange(HandoffError):
    code = "span_out_of_range"


class SpanReachesFinalToken(HandoffError):
    code = "span_reaches_final_token"


class KVRequired(HandoffError):
    code = "kv_required"


class UnsupportedRequest(HandoffError):
    code = "unsupported_request"


class FingerprintMismatch(HandoffError):
    code = "fingerprint_mismatch"


class DigestMismatch(HandoffError):
    code = "digest_mismatch"


class Unsigned(HandoffError):
    code = "unsigned"


class Expired(HandoffError):
    code = "expired"


class Replayed(HandoffError):
    """Admitted before: by this decode replica, or (its claim refused) by another one."""

    code = "replayed"


class ClaimFailed(HandoffError):
    """The prefill instance that holds the handoff's KV could not be asked for it (stopped,
    restarted, unreachable): its KV is gone with it, so decode pulls nothing. The frontend
    prefills again."""

    code = "claim_failed"


class PositionStateMissing(HandoffError):
    """The model derives positions from each image's grid and the handoff carries none."""

    code = "position_state_missing"


class PositionStateUnexpected(HandoffError):
    """Grids for a model whose positions do not depend on them."""

    code = "position_state_unexpected"


class PositionStateMismatch(HandoffError):
    """A grid that does not fit its item: another item count, a non-positive or multi-frame
    grid, or one whose merged size is not the item's placeholder length."""

    code = "position_state_mismatch"


class KVMismatch(HandoffError):
    """The KV blocks the handoff names do not match its token ids (checked by the engine
    adapter, which knows the block size and the connector's parameters)."""

    code = "kv_mismatch"
