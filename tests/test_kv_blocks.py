"""The adapter's check that a handoff's KV blocks are exactly its prompt's (vLLM trusts the
connector's block list: too few blocks kill the decode engine, too many tokens' worth pull the
wrong positions). The engine tier sends such handoffs to a live engine (test_admission_engine)."""

from __future__ import annotations

import pytest

from mmhandoff.vllm_adapter.vllm_engine import check_blocks
from mmhandoff.wire.handoff import Features, Handoff, KVMismatch, Sampling

pytestmark = pytest.mark.unit


def handoff(tokens: int, block_ids) -> Handoff:
    return Handoff(v=1, request_id="r", model_fingerprint="f", token_ids=list(range(tokens)),
                   features=Features(mm_hashes={}, mm_placeholders={}), requires_kv=True,
                   kv_transfer_params={"remote_block_ids": block_ids}, sampling=Sampling())


@pytest.mark.parametrize("tokens, block_ids", [
    (81, [7, 8, 9]),  # 81 tokens in blocks of 32: 3 blocks
    (64, [7, 8]),  # exactly full blocks
    (81, [[7, 8, 9], [1, 2, 3]]),  # one list per KV-cache group
])
def test_the_blocks_of_an_honest_handoff_pass(tokens, block_ids):
    check_blocks(handoff(tokens, block_ids), 32)


@pytest.mark.parametrize("tokens, block_ids", [
    (81, [7, 8]),  # more tokens than the blocks hold
    (65, [7, 8]),  # one token more
    (31, [7, 8]),  # fewer tokens: decode would pull the last block into the first positions
    (81, [[7, 8, 9], [1, 2]]),  # one group short
    (81, []), (81, 5), (81, "7,8,9"), (81, [7, None, 9][:2]),
])
def test_blocks_that_do_not_match_the_tokens_are_refused(tokens, block_ids):
    with pytest.raises(KVMismatch, match="KV blocks"):
        check_blocks(handoff(tokens, block_ids), 32)


def test_a_handoff_that_names_no_blocks_is_left_to_the_fail_closed_scheduler():
    h = handoff(81, None)
    h.kv_transfer_params = {}
    check_blocks(h, 32)
