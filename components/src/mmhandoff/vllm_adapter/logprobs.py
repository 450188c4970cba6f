"""vLLM's per-token log probabilities as the wire's TokenLogprob (sampled tokens) and
PromptLogprobs (the prompt's).

vLLM gives, for each sampled position, a dict {token id: Logprob(logprob, rank, decoded_token)}
holding the sampled token and the `logprobs` most likely ones (ranks 1..k); the sampled token
may rank below k. (`FlatLogprobs`, vLLM's compact form, indexes the same way.)
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

from mmhandoff.wire.messages import PromptLogprobs, TokenLogprob, TopLogprob


def token_logprobs(positions: Sequence[Any], token_ids: Sequence[int], k: int,
                   decode: Callable[[int], str]) -> list[TokenLogprob]:
    """One TokenLogprob per sampled token: `positions[i]` is vLLM's dict for `token_ids[i]`;
    `k` how many top tokens to keep; `decode` a token's text when vLLM did not detokenize it."""
    out = []
    for token_id, position in zip(token_ids, positions):
        def text(tid: int, lp) -> str:
            return lp.decoded_token if lp.decoded_token is not None else decode(tid)

        chosen = position[token_id]
        ranked = sorted(((lp.rank, tid, lp) for tid, lp in position.items()
                         if lp.rank is not None and lp.rank <= k), key=lambda r: r[0])
        out.append(TokenLogprob(
            token_id=token_id, token=text(token_id, chosen), logprob=chosen.logprob,
            top=[TopLogprob(token_id=tid, token=text(tid, lp), logprob=lp.logprob)
                 for _, tid, lp in ranked]))
    return out


def prompt_logprobs(token_ids: Sequence[int], positions: Sequence[Any], k: int,
                    decode: Callable[[int], str]) -> PromptLogprobs:
    """The prompt's log probabilities: vLLM's `prompt_logprobs` has None for the first token
    (nothing precedes it), then one dict per token as for sampled ones."""
    return PromptLogprobs(first_token_id=token_ids[0], first_token=decode(token_ids[0]),
                          rest=token_logprobs(positions[1:], token_ids[1:], k, decode))
