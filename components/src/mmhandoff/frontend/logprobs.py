"""Log probabilities in OpenAI's two answer formats, as vLLM's server writes them: chat's
`{"content": [{token, logprob, bytes, top_logprobs}]}`, and completions' parallel lists
(`tokens`, `token_logprobs`, `top_logprobs` as {token: logprob} including the sampled token,
`text_offset`). A logprob of -inf (a token that top_k, top_p or min_p ruled out) is written as
-9999.0, as vLLM does: JSON has no infinity."""

from __future__ import annotations

from mmhandoff.wire.messages import PromptLogprobs, TokenLogprob

FLOOR = -9999.0


def _lp(value: float) -> float:
    return max(value, FLOOR)


def chat(entries: list[TokenLogprob]) -> dict:
    def one(token: str, logprob: float) -> dict:
        return {"token": token, "logprob": _lp(logprob), "bytes": list(token.encode())}

    return {"content": [{**one(e.token, e.logprob),
                         "top_logprobs": [one(t.token, t.logprob) for t in e.top]}
                        for e in entries]}


def completion(entries: list[TokenLogprob], offset: int,
               prompt: PromptLogprobs | None = None) -> dict:
    """`offset`: where the first entry's token starts in the answer's text. `prompt` (echo with
    logprobs): the prompt's tokens come first, the first with null logprobs, and offsets count
    token texts from there, as vLLM's do."""
    out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [],
                            "text_offset": []}
    if prompt is not None:
        out = {"tokens": [prompt.first_token], "token_logprobs": [None], "top_logprobs": [None],
               "text_offset": [offset]}
        offset += len(prompt.first_token)
        entries = [*prompt.rest, *entries]
    for e in entries:
        out["tokens"].append(e.token)
        out["token_logprobs"].append(_lp(e.logprob))
        out["top_logprobs"].append({**{t.token: _lp(t.logprob) for t in e.top},
                                    e.token: _lp(e.logprob)})
        out["text_offset"].append(offset)
        offset += len(e.token)
    return out


def for_api(api: str, entries: list[TokenLogprob] | None, offset: int = 0,
            prompt: PromptLogprobs | None = None) -> dict | None:
    """The answer's (or a streamed piece's) `logprobs` field: None when none were asked.
    `prompt`: completions' echo with logprobs (chat never has it)."""
    if entries is None:
        return None
    return chat(entries) if api == "chat" else completion(entries, offset, prompt)


def text_length(prompt: PromptLogprobs, entries: list[TokenLogprob] | None) -> int:
    """Where the next token's text starts after the prompt's tokens and `entries`, as `completion`
    counts offsets."""
    return (len(prompt.first_token) + sum(len(e.token) for e in prompt.rest)
            + sum(len(e.token) for e in entries or ()))
