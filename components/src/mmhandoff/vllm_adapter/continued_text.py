"""The text of a migrated answer, as its first decode would have streamed it.

A migrated request's prompt is the original prompt followed by the answer's tokens already sent.
vLLM primes its incremental detokenizer with the whole prompt, and when those tokens end inside a
character (byte-level tokens: common for a tiny random model, possible for any), the first text it
emits repeats or drops what the first decode had streamed: a migrated answer's text differed from
the uninterrupted one though its tokens were equal (tests/test_graphs.py, 2026-12-05). Here a
detokenizer of vLLM's own kind is primed with the original prompt and stepped through the tokens
already sent, their text discarded (the client has it); the new tokens' text then follows exactly
as it would have.
"""

from __future__ import annotations

import copy

from vllm.v1.engine.detokenizer import IncrementalDetokenizer


class ContinuedText:
    def __init__(self, tokenizer, request, continued: int) -> None:
        """`request`: vLLM's EngineCoreRequest of the migrated answer (prompt + `continued`
        tokens already sent)."""
        ids = list(request.prompt_token_ids)
        original = copy.copy(request)
        original.prompt_token_ids = ids[:len(ids) - continued]
        self._detokenizer = IncrementalDetokenizer.from_new_request(tokenizer, original)
        self._detokenizer.update(ids[len(ids) - continued:], False)
        self._detokenizer.get_next_output_text(False, True)  # sent by the first decode

    def next(self, token_ids: list[int], finish_reason: str | None) -> str:
        """The text of the answer's next tokens (a stop token's own text excluded, as vLLM
        does)."""
        self._detokenizer.update(token_ids, finish_reason == "stop")
        return self._detokenizer.get_next_output_text(finish_reason is not None, True)
