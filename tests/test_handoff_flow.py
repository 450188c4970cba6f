"""The handoff on real engines: parity, hash parity, KV really moves, decode has no encoder."""

from __future__ import annotations

import time

import msgspec
import pytest

from mmhandoff.agg.worker import AggWorker
from mmhandoff.decode.full_media import FullMediaDecodeWorker
from mmhandoff.decode.worker import DecodeWorker
from mmhandoff.prefill.worker import PrefillWorker
from mmhandoff.wire.handoff import Sampling, decode_handoff
from mmhandoff.wire.messages import PrefillRequest
from tests.conftest import chat, data_uri, encode, make_image
from tests.flows import agg_run, full_media_run, greedy, handoff_run, published_chain

pytestmark = pytest.mark.engine


@pytest.fixture(scope="session")
def workers(engines):
    return (PrefillWorker(engines.prefill), DecodeWorker(engines.decode, kv_deadline_s=30),
            FullMediaDecodeWorker(engines.full, kv_deadline_s=30))


CASES = {
    "640x480-png": [(640, 480, "PNG", 1)],
    "224x224-png": [(224, 224, "PNG", 2)],
    "12mp-jpeg": [(4000, 3000, "JPEG", 3)],
    "two-images": [(320, 240, "PNG", 4), (800, 600, "JPEG", 5)],
}


@pytest.mark.parametrize("case", list(CASES))
def test_parity_handoff_agg_full_media(loop, workers, engines, case):
    prefill, decode, full = workers
    blobs = [encode(make_image(w, h, seed), fmt) for w, h, fmt, seed in CASES[case]]
    mimes = ["image/jpeg" if b[:2] == b"\xff\xd8" else "image/png" for b in blobs]
    messages = chat("Describe the pictures.", *(data_uri(b, m) for b, m in zip(blobs, mimes)))
    s = greedy(32, ignore_eos=True)
    handoff_tokens, last, handoff = loop.run(handoff_run(prefill, decode, f"par-{case}", messages, s))
    agg_tokens = loop.run(agg_run(prefill, engines.full, f"par-{case}", messages, s))
    full_tokens, full_last = loop.run(
        full_media_run(prefill, full, f"par-{case}", messages, s, blobs))
    assert len(agg_tokens) == 32
    assert handoff_tokens == agg_tokens == full_tokens
    # both decode engines say where every prompt token's KV came from (pulled from prefill, or
    # their own prefix cache: the full-media engine served agg's run of the same prompt)
    for stats in (last.stats, full_last.stats):
        assert stats.kv_tokens_pulled + stats.kv_tokens_local == len(handoff.token_ids), stats
    assert last.stats.kv_tokens_pulled > 0
    # the decode tier got metadata only: one hash and one span per image, no pixels
    assert len(handoff.features.mm_hashes["image"]) == len(blobs)
    assert last.stats.request_bytes < 4096 < sum(map(len, blobs))


def test_a_seeded_answer_is_deterministic_and_starts_with_aggs_token(loop, workers, engines):
    """Sampling with a seed (docs/architecture.md, "The answer's first token"): the same seed
    gives the same answer; its first token (prefill's draw) is agg's; from the second on it may
    differ from agg's, since decode's generator starts afresh where agg's had drawn once."""
    prefill, decode, _ = workers
    messages = chat("Tell me.", data_uri(encode(make_image(160, 120, 79))))
    s = Sampling(max_tokens=12, temperature=1.0, seed=7, ignore_eos=True)
    runs = [loop.run(handoff_run(prefill, decode, f"seeded-{i}", messages, s))[0]
            for i in range(2)]
    agg = loop.run(agg_run(prefill, engines.full, "seeded-agg", messages, s))
    assert runs[0] == runs[1] and len(runs[0]) == 12
    assert runs[0][0] == agg[0]
    other = loop.run(handoff_run(prefill, decode, "seeded-other", messages,
                                 msgspec.structs.replace(s, seed=8)))[0]
    assert other != runs[0]  # the seed matters


def test_different_images_give_different_answers(loop, workers):
    """Guards the parity test: the tiny model's output must depend on the image."""
    prefill, decode, _ = workers
    outs = [loop.run(handoff_run(prefill, decode, f"diff-{i}",
                                 chat("What is it?", data_uri(encode(make_image(64, 64, 100 + i)))),
                                 greedy(16, ignore_eos=True)))[0] for i in range(2)]
    assert outs[0] != outs[1]


def _wait_for(predicate, timeout=10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()


def test_block_hashes_equal_on_prefill_and_decode(loop, workers, engines):
    prefill, decode, _ = workers
    uri = data_uri(encode(make_image(300, 200, 7)))
    _, _, h = loop.run(handoff_run(prefill, decode, "hash-a", chat("Hash me.", uri), greedy(4)))
    assert len(h.token_ids) // 32 >= 2
    assert _wait_for(lambda: published_chain(engines.prefill_events, h.token_ids)
                     and published_chain(engines.decode_events, h.token_ids))
    d_hashes = published_chain(engines.decode_events, h.token_ids)
    assert published_chain(engines.prefill_events, h.token_ids) == d_hashes
    # the image's identity is part of the hash: the blocks holding image tokens carry it
    image_hash = h.features.mm_hashes["image"][0]
    extra = [b.extra_keys for b in engines.decode_events.stored() if b.block_hash in d_hashes]
    assert any(e and any(image_hash in map(str, k) for k in e) for e in extra)

    # the same text with another image: same token ids, but a new first-block hash (the first
    # block already holds image tokens, so the image's identity is in its hash)
    def firsts():
        return {b.block_hash for b in engines.decode_events.stored()
                if b.token_ids == tuple(h.token_ids[:32]) and b.parent is None}

    before = firsts()
    uri2 = data_uri(encode(make_image(300, 200, 8)))
    _, _, h2 = loop.run(handoff_run(prefill, decode, "hash-b", chat("Hash me.", uri2), greedy(4)))
    assert h2.token_ids == h.token_ids
    assert h2.features.mm_hashes != h.features.mm_hashes
    assert _wait_for(lambda: firsts() - before)
    assert len(firsts() - before) == 1  # exactly h2's first block, under a hash of its own


def test_kv_really_moves_and_local_cache_is_reused(loop, workers):
    prefill, decode, _ = workers
    uri = data_uri(encode(make_image(500, 400, 11)))
    first_tokens, first, h = loop.run(
        handoff_run(prefill, decode, "move-1", chat("First look.", uri), greedy(8)))
    span = h.features.mm_placeholders["image"][0]
    image_blocks_end = ((span.offset + span.length) // 32) * 32  # full blocks holding image tokens
    assert first.stats.kv_tokens_pulled >= image_blocks_end > 0
    assert first.stats.kv_positions_covered >= span.offset + span.length
    # same image, same decode engine: the image blocks now come from its own prefix cache
    _, second, _ = loop.run(
        handoff_run(prefill, decode, "move-2", chat("First look.", uri), greedy(8)))
    assert second.stats.kv_tokens_local >= image_blocks_end
    assert second.stats.kv_tokens_pulled < first.stats.kv_tokens_pulled


def test_decode_engine_has_no_vision_tower(loop, engines):
    def tower(worker):
        model = worker.model_runner.model
        return type(getattr(model, "vision_tower", None)).__name__

    assert loop.run(engines.decode.llm.collective_rpc(tower)) == ["StageMissingLayer"]
    assert loop.run(engines.full.llm.collective_rpc(tower)) != ["StageMissingLayer"]


def test_the_older_contract_answers_as_agg_when_its_first_token_stops_it(loop, workers, engines):
    """Decode samples the first token (`first_token` False): prefill's one token stops the
    answer (a stop token here; EOS alike), vLLM's NIXL producer still holds the blocks and names
    them (it does for stopped requests too); decode pulls them (which releases them on prefill)
    and regenerates the same token: the answer equals one engine's."""
    prefill, decode, _ = workers
    messages = chat("Say nothing.", data_uri(encode(make_image(96, 96, 77))))
    first = loop.run(agg_run(prefill, engines.full, "stop-first", messages, greedy(4)))[0]
    s = greedy(4, stop_token_ids=[first])
    reference = loop.run(agg_run(prefill, engines.full, "stop-agg", messages, s))
    tokens, last, h = loop.run(handoff_run(prefill, decode, "stop", messages, s, first_token=False))
    assert (tokens, last.finish_reason) == (reference, "stop") == ([first], "stop")
    assert last.stats.kv_tokens_pulled > 0 and h.first_token is None


def test_a_prompt_that_fills_its_last_block_exactly(loop, workers, engines):
    """Decode's prompt is prefill's plus the first token: one block longer than what prefill
    holds when prefill's prompt ends on a block boundary. The connector pulls prefill's blocks
    only (PULLED_TOKENS_KEY) and the answer equals agg's."""
    prefill, decode, _ = workers
    uri = data_uri(encode(make_image(200, 150, 78)))
    block = engines.decode.block_size

    async def length(text: str) -> int:
        request = PrefillRequest(request_id="len", messages=chat(text, uri))
        images = await prefill.prompts.media(request)
        return len((await engines.prefill.render(prefill.prompts.text(request), images)).token_ids)

    # one more "?" is one more token (the tiny model's byte-level tokenizer)
    text = next(t for t in ("?" * k for k in range(1, 2 * block))
                if loop.run(length(t)) % block == 0)
    messages = chat(text, uri)
    s = greedy(12, ignore_eos=True)
    tokens, last, h = loop.run(handoff_run(prefill, decode, "exact", messages, s))
    assert len(h.token_ids) % block == 0
    assert tokens == loop.run(agg_run(prefill, engines.full, "exact-agg", messages, s))
    # every position prefill computed came from KV (pulled, or decode's own cache)
    assert last.stats.kv_tokens_pulled + last.stats.kv_tokens_local == len(h.token_ids)
    assert last.stats.kv_tokens_pulled > 0
    assert last.stats.prompt_tokens == len(h.token_ids)  # the first token is the answer's


def test_an_image_rendered_but_never_submitted_does_not_fail_the_next_request(
        loop, workers, engines):
    """vLLM's renderer marks an image as sent to the engine when it renders it; a prompt that is
    rendered but never submitted (refused as too long, say) leaves the engine without it, and
    the engine answers the next request with that image with a retryable error. Prefill renders
    again (the renderer has dropped the mark) and the answer is agg's."""
    prefill, decode, _ = workers
    messages = chat("Again?", data_uri(encode(make_image(180, 120, 81))))
    s = greedy(6, ignore_eos=True)
    request = PrefillRequest(request_id="drift-render", messages=messages, sampling=s)
    images = loop.run(prefill.prompts.media(request))
    loop.run(engines.prefill.render(prefill.prompts.text(request), images))  # never submitted
    tokens, _, _ = loop.run(handoff_run(prefill, decode, "drift", messages, s))
    assert tokens == loop.run(agg_run(prefill, engines.full, "drift-agg", messages, s))


async def streamed(chunks) -> list[tuple[int, str]]:
    """(token, text) per token of a stream of chunks; a chunk's text goes with its last token."""
    out = []
    async for c in chunks:
        out += [(t, "") for t in c.token_ids[:-1]] + [(c.token_ids[-1], c.text)]
    return out


def whole_answer(loop, prefill, decode, request) -> list[tuple[int, str]]:
    """(token, text) of every token of an answer: prefill's first, then decode's."""
    answer = loop.run(prefill.prefill(request))
    first = [(answer.first.token_id, answer.first.text)]
    if answer.handoff is None:  # it ended at its first token
        return first
    return first + loop.run(streamed(decode.generate(answer.handoff)))


def continued(loop, prefill, decode, messages, answer, k: int) -> list[tuple[int, str]]:
    """The rest of `answer` ((token, text) pairs) after its first k tokens, as a migrated request
    gets it: prefill computes the prompt followed by them and samples the next token, decode
    goes on."""
    request = PrefillRequest(request_id=f"mig-{k}", messages=messages,
                             sampling=greedy(len(answer) - k, ignore_eos=True),
                             continuation=[t for t, _ in answer[:k]])
    return whole_answer(loop, prefill, decode, request)


def test_an_answer_continued_from_its_first_tokens_goes_on_as_agg(loop, workers, engines):
    """Migration on real engines: prefill computes the prompt followed by the first k tokens of
    agg's answer, decode pulls that KV and goes on. Tokens and streamed text equal agg's, also
    where the first k tokens end inside a character (the tiny model's answers are mostly
    byte-level tokens of broken UTF-8)."""
    prefill, decode, _ = workers
    messages = chat("Describe it.", data_uri(encode(make_image(320, 240, 7))))
    n = 24
    agg = loop.run(streamed(AggWorker(engines.full).generate(PrefillRequest(
        request_id="mig", messages=messages, sampling=greedy(n, ignore_eos=True)))))
    assert len(agg) == n
    for k in (0, 1, 2, 3, 5, 8, 13):  # 0: the whole answer, prefill's token and decode's
        rest = continued(loop, prefill, decode, messages, agg, k)
        assert [t for t, _ in agg[k:]] == [t for t, _ in rest], k
        assert "".join(x for _, x in agg) == "".join(x for _, x in agg[:k] + rest), k


def test_an_agg_answer_continued_from_its_first_tokens_goes_on_as_before(loop, engines):
    """The agg graph's retry after tokens went out (its one worker restarted): the same
    continuation on the agg worker, tokens and text equal to the uninterrupted answer."""
    messages = chat("Describe it.", data_uri(encode(make_image(320, 240, 7))))
    agg = AggWorker(engines.full)
    n = 16
    whole = loop.run(streamed(agg.generate(PrefillRequest(
        request_id="agg-whole", messages=messages, sampling=greedy(n, ignore_eos=True)))))
    for k in (1, 2, 3, 5):
        rest = loop.run(streamed(agg.generate(PrefillRequest(
            request_id=f"agg-cont-{k}", messages=messages,
            sampling=greedy(n - k, ignore_eos=True), continuation=[t for t, _ in whole[:k]]))))
        assert [t for t, _ in whole[k:]] == [t for t, _ in rest], k
        assert "".join(x for _, x in whole) == "".join(x for _, x in whole[:k] + rest), k


# Sampling settings that must hold for the whole answer, prefill's first token and decode's
# rest alike: each case's answer equals agg's (vLLM applying them to one engine's whole answer)
# and differs from plain greedy (so it was applied, not ignored). `first_token` False: the
# frontend lets decode sample every token when penalties count the answer's tokens.
SAMPLING_CASES = {
    "repetition_penalty": (dict(repetition_penalty=1.8), True),
    "frequency_penalty": (dict(frequency_penalty=2.0), False),
    "presence_penalty": (dict(presence_penalty=2.0), False),
}


@pytest.mark.parametrize("case", list(SAMPLING_CASES))
def test_sampling_settings_hold_across_prefill_and_decode(loop, workers, engines, case):
    prefill, decode, _ = workers
    settings, first_token = SAMPLING_CASES[case]
    messages = chat("Say more.", data_uri(encode(make_image(96, 64, 40))))
    plain = loop.run(agg_run(prefill, engines.full, f"s-{case}-plain", messages,
                             greedy(24, ignore_eos=True)))
    s = greedy(24, ignore_eos=True, **settings)
    agg = loop.run(agg_run(prefill, engines.full, f"s-{case}-agg", messages, s))
    tokens, _, h = loop.run(handoff_run(prefill, decode, f"s-{case}", messages, s,
                                        first_token=first_token))
    assert (h.first_token is not None) == first_token
    assert tokens == agg != plain


def test_logit_bias_holds_on_prefill_and_decode(loop, workers, engines):
    """A bias holds for every token, prefill's first and decode's rest: tokens forbidden
    (-100) never appear and the answer is agg's; a token favoured by +100 is every token."""
    prefill, decode, _ = workers
    messages = chat("Go on.", data_uri(encode(make_image(96, 64, 33))))
    plain = loop.run(agg_run(prefill, engines.full, "b-plain", messages,
                             greedy(16, ignore_eos=True)))
    banned = {plain[0], plain[5]}
    s = greedy(16, ignore_eos=True, logit_bias={str(t): -100.0 for t in banned})
    agg = loop.run(agg_run(prefill, engines.full, "b-agg", messages, s))
    tokens, _, h = loop.run(handoff_run(prefill, decode, "b-split", messages, s))
    assert h.first_token is not None  # prefill sampled the first token under the bias
    assert tokens == agg != plain and not banned & set(tokens)
    favoured = plain[3]
    s = greedy(16, ignore_eos=True, logit_bias={str(favoured): 100.0})
    tokens, _, _ = loop.run(handoff_run(prefill, decode, "b-favoured", messages, s))
    assert tokens == [favoured] * 16


def test_top_k_and_min_p_hold_on_prefill_and_decode(loop, workers, engines):
    """At temperature 1, top_k 1 (and, alone, min_p 1) leaves only the likeliest token: the
    sampled answer is the greedy one only if both prefill and decode applied it."""
    prefill, decode, _ = workers
    messages = chat("Go on.", data_uri(encode(make_image(96, 64, 32))))
    plain = loop.run(agg_run(prefill, engines.full, "k-plain", messages,
                             greedy(16, ignore_eos=True)))
    for name, settings in (("top_k", dict(top_k=1)), ("min_p", dict(min_p=1.0))):
        s = Sampling(max_tokens=16, temperature=1.0, seed=5, ignore_eos=True, **settings)
        tokens, _, _ = loop.run(handoff_run(prefill, decode, f"k-{name}", messages, s))
        assert tokens == plain, name
    unbounded = Sampling(max_tokens=16, temperature=1.0, seed=5, ignore_eos=True)
    assert loop.run(handoff_run(prefill, decode, "k-none", messages, unbounded))[0] != plain


def test_min_tokens_counts_the_whole_answer(loop, workers, engines):
    """Stop tokens are masked until the answer has min_tokens tokens, whichever engine samples
    them: prefill's first token counts, so decode's share is one less. The stop set holds the
    greedy first token (prefill must not stop on it) and a token agg samples right at the
    min_tokens mark `i` (decode must stop there: with min_tokens not reduced it would not)."""
    prefill, decode, _ = workers
    messages = chat("Tell me.", data_uri(encode(make_image(96, 64, 33))))
    first = loop.run(agg_run(prefill, engines.full, "m-plain", messages, greedy(16)))[0]
    masked = loop.run(agg_run(prefill, engines.full, "m-masked", messages,
                              greedy(16, min_tokens=8, stop_token_ids=[first])))
    # a mark whose token is new there: masking it earlier changes no earlier choice
    i = next(i for i in range(2, 9) if masked[i] != first and masked[i] not in masked[:i])
    s = greedy(16, min_tokens=i, stop_token_ids=[first, masked[i]])
    agg = loop.run(agg_run(prefill, engines.full, "m-agg", messages, s))
    assert agg[:i] == masked[:i] and len(agg) == i + 1  # stopped at the mark
    tokens, last, _ = loop.run(handoff_run(prefill, decode, "m-handoff", messages, s))
    assert tokens == agg and last.finish_reason == "stop"


async def ended(chunks) -> tuple[list[int], str, str | None]:
    """Token ids, text and finish reason of a stream of chunks."""
    ids, text, finish = [], "", None
    async for c in chunks:
        ids += c.token_ids
        text += c.text
        finish = c.finish_reason or finish
    return ids, text, finish


def _stop_in_the_middle(text: str, start: int) -> str:
    """Three characters of `text` from `start` on that occur there first (and are whole)."""
    return next(text[i:i + 3] for i in range(start, len(text) - 3)
                if text.find(text[i:i + 3]) == i and "\ufffd" not in text[i:i + 3])


def test_stop_strings_end_the_answer_where_agg_ends_it(loop, workers, engines):
    """Tokens, text (cut before the stop string, or after it when asked to include it) and
    finish reason equal agg's. Decode samples the whole answer, as the frontend asks for a
    request with stop strings."""
    prefill, decode, _ = workers
    messages = chat("Describe it.", data_uri(encode(make_image(320, 240, 8))))
    agg_worker = AggWorker(engines.full)

    def agg(rid, s):
        return loop.run(ended(agg_worker.generate(PrefillRequest(
            request_id=rid, messages=messages, sampling=s))))

    _, plain, _ = agg("stop-plain", greedy(24, ignore_eos=True))
    stop = _stop_in_the_middle(plain, len(plain) // 3)
    for include in (False, True):
        s = greedy(24, ignore_eos=True, stop=[stop], include_stop_str_in_output=include)
        ids, text, finish = agg(f"stop-agg-{include}", s)
        cut = plain.index(stop) + (len(stop) if include else 0)
        assert (text, finish) == (plain[:cut], "stop") and len(ids) < 24
        handoff, _ = loop.run(prefill.handoff(PrefillRequest(
            request_id=f"stop-{include}", messages=messages, sampling=s, first_token=False)))
        assert loop.run(ended(decode.generate(handoff))) == (ids, text, finish), include


def test_a_stop_string_that_began_in_the_tokens_already_sent_ends_a_continued_answer(
        loop, workers, engines):
    """A migrated answer: the stop string spans the tokens already sent and the next one. vLLM's
    engine sees only its own output; the adapter's continued text sees both, and the answer
    ends at the same token as agg's."""
    prefill, decode, _ = workers
    messages = chat("Describe it.", data_uri(encode(make_image(320, 240, 9))))
    plain = loop.run(streamed(AggWorker(engines.full).generate(PrefillRequest(
        request_id="cstop-plain", messages=messages, sampling=greedy(24, ignore_eos=True)))))
    texts = [t for _, t in plain]
    # k: a boundary with whole text on both sides; the stop string: last char sent + next 2
    k = next(k for k in range(4, 20) if texts[k - 1] and len(texts[k]) >= 2
             and "\ufffd" not in texts[k - 1][-1] + texts[k][:2])
    stop = texts[k - 1][-1] + texts[k][:2]
    full = "".join(texts)
    assert full.find(stop) == len("".join(texts[:k])) - 1, "the premise: it first occurs there"
    s = greedy(24, ignore_eos=True, stop=[stop])
    request = PrefillRequest(request_id="cstop", messages=messages, first_token=False,
                             sampling=greedy(24 - k, ignore_eos=True, stop=[stop]),
                             continuation=[t for t, _ in plain[:k]])
    handoff, _ = loop.run(prefill.handoff(request))
    ids, _, finish = loop.run(ended(decode.generate(handoff)))
    agg_ids, _, agg_finish = loop.run(ended(AggWorker(engines.full).generate(PrefillRequest(
        request_id="cstop-agg", messages=messages, sampling=s))))
    assert (agg_finish, len(agg_ids)) == ("stop", k + 1)
    assert ([t for t, _ in plain[:k]] + ids, finish) == (agg_ids, "stop")


async def _logprobs(chunks) -> list:
    out = []
    async for chunk in chunks:
        out += chunk.logprobs or []
    return out


def test_logprobs_of_a_split_answer_are_the_agg_answers(loop, workers, engines):
    """Prefill's first token and decode's pulled-KV continuation give each token the logprob and
    top tokens the agg engine gives it. Independently of the agg run: a greedy token is its
    position's likeliest (rank 1, the same logprob), the top tokens come likeliest first, and
    their probabilities sum to at most 1."""
    import math

    prefill, decode, _ = workers
    messages = chat("Say more.", data_uri(encode(make_image(96, 64, 41))))
    s = greedy(8, ignore_eos=True, logprobs=3)
    agg = loop.run(_logprobs(AggWorker(engines.full).generate(PrefillRequest(
        request_id="lp-agg", messages=messages, sampling=s))))
    answer = loop.run(prefill.prefill(PrefillRequest(request_id="lp", messages=messages,
                                                     sampling=s)))
    split = [answer.first.logprob, *loop.run(_logprobs(decode.generate(answer.handoff)))]
    assert len(split) == len(agg) == 8
    for got, want in zip(split, agg):
        assert (got.token_id, got.token) == (want.token_id, want.token)
        assert [t.token_id for t in got.top] == [t.token_id for t in want.top]
        assert abs(got.logprob - want.logprob) < 1e-4
        assert got.top[0].token_id == got.token_id and got.top[0].logprob == got.logprob
        assert len(got.top) == 3
        assert [t.logprob for t in got.top] == sorted((t.logprob for t in got.top),
                                                      reverse=True)
        assert sum(math.exp(t.logprob) for t in got.top) <= 1 + 1e-6
    plain = loop.run(_logprobs(AggWorker(engines.full).generate(PrefillRequest(
        request_id="lp-none", messages=messages, sampling=greedy(4, ignore_eos=True)))))
    assert plain == []  # none asked, none computed or sent


def test_a_structured_answer_is_sampled_by_decode_and_follows_its_schema(loop, workers, engines):
    """A JSON schema (structured outputs): prefill samples no first token (the grammar advances
    over an engine's own output), decode samples the whole answer on the pulled KV. It equals
    the agg engine's answer; a regex spelling the schema's objects gives text that parses and
    validates against the schema (jsonschema, not the code under test); a choice constraint
    answers one of its strings."""
    import json

    import jsonschema

    from mmhandoff.wire.handoff import Structured

    prefill, decode, _ = workers
    messages = chat("Describe it as JSON.", data_uri(encode(make_image(96, 64, 42))))
    schema = {"type": "object", "properties": {"colour": {"enum": ["red", "green", "blue"]},
                                               "round": {"type": "boolean"}},
              "required": ["colour", "round"], "additionalProperties": False}
    # the regex spells the schema's objects without whitespace (vLLM lets a JSON grammar put
    # any whitespace between tokens: a random model's answer need not end within max_tokens)
    regex = r'\{"colour":"(red|green|blue)","round":(true|false)\}'
    for name, structured, check in (
            ("regex", Structured(regex=regex),
             lambda text: jsonschema.validate(json.loads(text), schema)),
            ("schema", Structured(json=schema), lambda text: text.lstrip().startswith("{")),
            ("choice", Structured(choice=["yes", "no", "maybe"]),
             lambda text: text in ("yes", "no", "maybe"))):
        s = greedy(64, structured=structured)
        request = PrefillRequest(request_id=f"so-{name}", messages=messages, sampling=s)
        agg = loop.run(streamed(AggWorker(engines.full).generate(request)))
        answer = loop.run(prefill.prefill(msgspec.structs.replace(
            request, request_id=f"so-{name}-split", first_token=False)))
        assert answer.first is None and decode_handoff(answer.handoff).first_token is None
        split = loop.run(streamed(decode.generate(answer.handoff)))
        assert split == agg, name
        text = "".join(t for _, t in split)
        assert check(text) is not False, (name, text)
