"""What older peers send, read here so that the current contract's code need not know them.

- Handoff versions 1-6: the fields each later version added must be absent (at their defaults)
  in an older handoff, and its prefill signed it without them, so its MAC leaves them out: a
  decode tier upgraded first keeps taking an older prefill's handoffs.
- The decode endpoint's older message: the Handoff's own fields in builtin form, where today it
  is the handoff's bytes (mmhandoff.wire.messages.HandoffMessage).

Nothing here imports the Handoff type: the functions take whatever the current module decoded.
"""

from __future__ import annotations

from typing import Any

import msgspec

from mmhandoff.wire.errors import MalformedHandoff

# Sampling's fields that version 3 added: an older handoff has them at their defaults.
SAMPLING_V3 = ("min_p", "repetition_penalty", "presence_penalty", "frequency_penalty",
               "min_tokens", "stop", "include_stop_str_in_output")

# Fields added since version 4, each appended at the end of its struct and None by default,
# with the version that added it. (Up to version 3, fields were not all appended: signatures of
# version 1-2 prefills do not verify at a version 3 or later decode.)
FIELDS_SINCE: dict[tuple[str, ...], int] = {("sampling", "structured"): 4,
                                             ("features", "mm_grids"): 5,
                                             ("sampling", "logit_bias"): 5,
                                             ("block_hashes",): 6,
                                             ("claim",): 7}

_encoder = msgspec.msgpack.Encoder()


def check_older(h: Any, default_sampling: Any) -> None:
    """An older handoff (`h.v` below the current version) uses none of the newer fields."""
    if h.v < 3 and any(getattr(h.sampling, f) != getattr(default_sampling, f)
                       for f in SAMPLING_V3):
        raise MalformedHandoff(f"{', '.join(SAMPLING_V3)} need handoff version 3")
    for *parents, name in _newer(h.v):
        node = h
        for parent in parents:
            node = getattr(node, parent)
        if getattr(node, name) is not None:  # each such field defaults to None
            raise MalformedHandoff(f"{'.'.join((*parents, name))} needs handoff version "
                                   f"{FIELDS_SINCE[(*parents, name)]}")
    # a grid's `seconds` (8) is omitted from the encoding while None, so an older MAC holds
    if h.v < 8 and any(g.seconds is not None
                       for grids in (h.features.mm_grids or {}).values() for g in grids):
        raise MalformedHandoff("a grid's seconds need handoff version 8")


def signed_body(unsigned: Any) -> bytes | None:
    """The bytes an older prefill signed for this handoff (its digest unset): the message as
    that prefill encoded it, without the newer fields (same map order, bytes as bytes). None:
    a current handoff, whose body is its own encoding."""
    newer = _newer(unsigned.v)
    if not newer:
        return None
    builtins = msgspec.to_builtins(unsigned, builtin_types=(bytes, bytearray))
    for *parents, name in newer:
        node = builtins
        for parent in parents:
            node = node[parent]
        node.pop(name, None)
    return _encoder.encode(builtins)


def encode_builtin_handoff(message: dict) -> bytes:
    """An older frontend's decode message (the Handoff's fields, as Dynamo delivered them) as the
    bytes the current readers decode. Its size is a re-encoding's, not what arrived."""
    try:
        return _encoder.encode(message)
    except (TypeError, msgspec.EncodeError) as e:
        raise MalformedHandoff(f"not a handoff message: {e}") from None


def _newer(version: int) -> list[tuple[str, ...]]:
    return [path for path, since in FIELDS_SINCE.items() if version < since]
