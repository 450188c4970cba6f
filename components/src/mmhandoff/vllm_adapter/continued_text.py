"""The text of an answer that goes on after tokens already sent, as one engine would stream it.

Such a request's prompt is the original prompt followed by the answer's tokens already sent (a
migrated answer; decode after prefill's first token; prefill after a migration's tokens). vLLM
primes its incremental detokenizer with the whole prompt, and when those tokens end inside a
character (byte-level tokens: common for a tiny random model, possible for any), the first text
it emits repeats or drops what was already streamed: a migrated answer's text differed from the
uninterrupted one though its tokens were equal (tests/test_graphs.py, 2026-12-05). Here a
detokenizer of vLLM's own kind is primed with the original prompt and stepped through the tokens
already sent, their text discarded (the client has it); the new tokens' text then follows exactly
as it would have.
"""

from __future__ import annotations

from types import SimpleNamespace

from vllm.v1.engine.detokenizer import IncrementalDetokenizer


class ContinuedText:
    def __init__(self, tokenizer, prompt_token_ids, sampling_params, continued: int) -> None:
        """`prompt_token_ids`: the request's whole prompt, whose last `continued` tokens are the
        answer's already sent."""
        ids = list(prompt_token_ids)
        original = SimpleNamespace(  # what vLLM's detokenizer reads of an EngineCoreRequest
            request_id="continued", prompt_token_ids=ids[:len(ids) - continued],
            prompt_embeds=None, sampling_params=sampling_params)
        self._detokenizer = IncrementalDetokenizer.from_new_request(tokenizer, original)
        self._detokenizer.update(ids[len(ids) - continued:], False)
        self._detokenizer.get_next_output_text(False, True)  # already sent

    def next(self, token_ids: list[int], finish_reason: str | None,
             stop_token: bool) -> tuple[str, str | None]:
        """The text of the answer's next tokens (a stop token's own text excluded, as vLLM
        does), and the stop string they completed, if any. The tokens already sent are this
        detokenizer's output too, so it also finds a stop string that begins in them, which the
        engine (whose output starts after them) cannot; the text is then cut there, as vLLM
        cuts it."""
        matched = self._detokenizer.update(token_ids, stop_token)
        finished = finish_reason is not None or matched is not None
        return self._detokenizer.get_next_output_text(finished, True), matched
