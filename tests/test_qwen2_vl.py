"""M-RoPE models (the tiny Qwen2-VL, Qwen2.5-VL and Qwen3-VL: every test runs on each) on the
media-free decode path: each image's grid travels in the handoff (v5), decode's engine computes positions
from it, and answers equal the aggregated engine's and full-media P/D's token for token."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import pytest

from mmhandoff.decode.full_media import FullMediaDecodeWorker
from mmhandoff.decode.worker import DecodeWorker, collect
from mmhandoff.prefill.worker import PrefillWorker
from mmhandoff.wire.handoff import (
    Grid,
    PositionStateMismatch,
    PositionStateMissing,
    PositionStateUnexpected,
    decode_handoff,
)
from mmhandoff.wire.messages import PrefillRequest
from tests.conftest import (
    chat,
    data_uri,
    encode,
    free_port,
    make_image,
    make_video,
    start,
    video_chat,
)
from tests.flows import (
    agg_run,
    assert_pooled_renders_alike,
    full_media_run,
    greedy,
    handoff_run,
)

pytestmark = pytest.mark.engine

MERGE = 2  # the tiny model's spatial merge (mmhandoff.models.tiny_qwen2_vl)


@pytest.fixture(scope="module", params=["qwen2_vl", "qwen2_5_vl", "qwen3_vl"])
def qwen_model(request) -> str:
    from mmhandoff.models.tiny import ensure_tiny_model

    return str(ensure_tiny_model(arch=request.param))


@pytest.fixture(scope="module")
def qwen(loop, qwen_model):
    """Prefill, decode (no vision tower) and a whole-VLM KV consumer (the aggregated reference
    and the full-media decode arm) of the tiny Qwen2-VL; stopped after this module."""
    from mmhandoff.vllm_adapter import EngineSpec

    from mmhandoff.vllm_adapter.kv_events import KVEventSubscriber

    common = dict(model=qwen_model, dtype="float32", kv_cache_gib=1)
    events = {"prefill": free_port(), "decode": free_port()}
    engines = [start(loop, EngineSpec(
        role=role, cpu_cores=cores, nixl_port=free_port(), **common,
        kv_events_endpoint=f"tcp://*:{events[role]}" if role in events else None))
        for role, cores in (("prefill", "0"), ("decode", "1"), ("full_media_decode", "1"))]
    prefill, decode, full = engines
    subscribers = [KVEventSubscriber(f"tcp://127.0.0.1:{port}") for port in events.values()]
    yield (PrefillWorker(prefill), DecodeWorker(decode, kv_deadline_s=30),
           FullMediaDecodeWorker(full, kv_deadline_s=30), full, *subscribers)
    for sub in subscribers:
        sub.close()
    for engine in engines:
        engine.shutdown()


CASES = {
    "640x480-png": [(640, 480, "PNG", 11)],
    "300x100-png": [(300, 100, "PNG", 12)],  # wide: a grid of 2 x 6 tokens
    "12mp-jpeg": [(4000, 3000, "JPEG", 13)],
    "two-images": [(320, 240, "PNG", 14), (120, 360, "JPEG", 15)],  # landscape, then portrait
}


def _blobs(case):
    return [encode(make_image(w, h, seed), fmt) for w, h, fmt, seed in CASES[case]]


def _messages(blobs, text="Describe the pictures."):
    mimes = ["image/jpeg" if b[:2] == b"\xff\xd8" else "image/png" for b in blobs]
    return chat(text, *(data_uri(b, m) for b, m in zip(blobs, mimes)))


@pytest.mark.parametrize("case", list(CASES))
def test_parity_handoff_agg_full_media(loop, qwen, case):
    prefill, decode, full, full_engine, *_ = qwen
    blobs = _blobs(case)
    messages = _messages(blobs)
    s = greedy(32, ignore_eos=True)
    tokens, last, handoff = loop.run(handoff_run(prefill, decode, f"q-{case}", messages, s))
    agg = loop.run(agg_run(prefill, full_engine, f"q-{case}", messages, s))
    full_tokens, _ = loop.run(full_media_run(prefill, full, f"q-{case}", messages, s, blobs))
    assert len(agg) == 32
    assert tokens == agg == full_tokens
    assert last.stats.kv_tokens_pulled > 0
    # each image's grid, one frame, merged into exactly its placeholder's tokens
    grids = handoff.features.mm_grids["image"]
    spans = handoff.features.mm_placeholders["image"]
    assert len(grids) == len(blobs)
    for grid, span in zip(grids, spans):
        assert grid.t == 1 and grid.h * grid.w // MERGE ** 2 == span.length
    if case == "300x100-png":  # the aspect ratio is kept (to whole 28-pixel tokens): 3:1
        assert 2.5 < grids[0].w / grids[0].h < 3.5
    if case == "two-images":  # one landscape, one portrait
        assert grids[0].w > grids[0].h and grids[1].h > grids[1].w
    assert last.stats.request_bytes < 4096 < sum(map(len, blobs))  # metadata only


def test_images_from_the_media_pool_are_the_same_engine_input(loop, qwen):
    """media.pool with the presizer this engine checked: the same token ids, identities, spans,
    grids and processed tensors as images prepared in the worker's threads
    (test_media_pool_engine.py: the same for LLaVA)."""
    # images no other test sends (see assert_pooled_renders_alike)
    assert_pooled_renders_alike(loop, qwen[0].engine, {
        "12mp": _messages([encode(make_image(4000, 3000, 91), "JPEG")]),
        "two": _messages([encode(make_image(320, 240, 92)),
                          encode(make_image(120, 360, 93), "JPEG")])})


def test_answers_depend_on_the_image(loop, qwen):
    prefill, decode, *_ = qwen
    answers = [loop.run(handoff_run(prefill, decode, f"q-dep-{seed}",
                                    _messages([encode(make_image(640, 480, seed))]),
                                    greedy(12, ignore_eos=True)))[0] for seed in (21, 22)]
    assert answers[0] != answers[1]


def test_vllm_greedy_equals_transformers(loop, qwen, qwen_model):
    """The builder writes a model vLLM and transformers read alike: transformers' greedy
    answer (its own processor, its own vision tower and M-RoPE code) is the aggregated
    engine's."""
    import io

    import torch
    from PIL import Image
    from transformers import AutoModelForImageTextToText, AutoProcessor

    prefill, _, _, full_engine, *_ = qwen
    blob = encode(make_image(320, 240, 23))
    messages = _messages([blob], "What is shown?")
    s = greedy(16, ignore_eos=True)
    ours = loop.run(agg_run(prefill, full_engine, "q-hf", messages, s))

    processor = AutoProcessor.from_pretrained(qwen_model)
    model = AutoModelForImageTextToText.from_pretrained(qwen_model, dtype=torch.float32)
    assert type(model).__name__ == json.loads(
        (Path(qwen_model) / "config.json").read_text())["architectures"][0]
    text = prefill.prompts.text(PrefillRequest(request_id="q-hf", messages=messages,
                                               sampling=s))
    inputs = processor(text=[text], images=[Image.open(io.BytesIO(blob)).convert("RGB")],
                       return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=16, do_sample=False)
    assert out[0, inputs["input_ids"].shape[1]:].tolist() == ours


def test_decode_engine_has_no_vision_tower(loop, qwen):
    _, decode, full, *_ = qwen

    def tower(worker):
        return type(getattr(worker.model_runner.model, "visual", None)).__name__

    assert loop.run(decode.engine.llm.collective_rpc(tower)) == ["StageMissingLayer"]
    assert loop.run(full.engine.llm.collective_rpc(tower)) != ["StageMissingLayer"]


def test_decodes_grid_field_is_the_models_own(loop, qwen):
    """The field decode gives the grid is the one vLLM's Qwen2-VL processor gives it (kept on
    the CPU, so the scheduler still sends it once the image's span is covered by KV); a
    text-only prompt has no grid."""
    from mmhandoff.vllm_adapter.positions import GRID_KEY, grid_feature_data

    prefill, *_ = qwen

    def render(blobs):
        request = PrefillRequest(request_id="q-field", messages=_messages(blobs),
                                 sampling=greedy(1))
        images = loop.run(prefill.prompts.media(request))
        return loop.run(prefill.engine.render(prefill.prompts.text(request), images))

    text_only = render([])
    assert text_only.features.mm_grids == {}
    rendered = render([encode(make_image(56, 84, 29))])
    (item,) = rendered.engine_input["mm_kwargs"]["image"]
    ours = grid_feature_data("image", rendered.features.mm_grids["image"][0])[GRID_KEY]
    assert ours.field == item[GRID_KEY].field and ours.field.keep_on_cpu
    assert ours.data.tolist() == item[GRID_KEY].data.tolist()
    for r in (text_only, rendered):
        prefill.engine.discard(r)  # never submitted


def test_an_image_sent_by_hash_alone_still_gets_its_grid(loop, qwen):
    """vLLM's renderer sends an image it already sent as its hash alone, without the processed
    data the grid is in: prefill takes the grid from its memo, or, with the memo emptied,
    renders the image afresh; the answer is the same every time."""
    from mmhandoff.vllm_adapter.positions import GridMemo

    prefill, decode, *_ = qwen
    messages = _messages([encode(make_image(200, 500, 24))])
    s = greedy(12, ignore_eos=True)
    runs = []
    for i in range(3):
        if i == 2:
            prefill.engine._grids = GridMemo()  # as if the image had left the memo
        tokens, _, handoff = loop.run(handoff_run(prefill, decode, f"q-again-{i}", messages, s))
        runs.append((tokens, handoff.features.mm_grids))
    assert runs[0] == runs[1] == runs[2]


def _handoff(loop, prefill, request_id, blobs):
    handoff, _ = loop.run(prefill.handoff(PrefillRequest(
        request_id=request_id, messages=_messages(blobs), sampling=greedy(8, ignore_eos=True))))
    return handoff


def _with_grids(handoff, grids):
    features = msgspec.structs.replace(handoff.features, mm_grids=grids)
    return msgspec.structs.replace(handoff, features=features)


def test_position_state_admission_on_the_engines(loop, qwen, engines):
    """Missing, inconsistent or unexpected grids: each its typed error, before the engine sees
    the request, and both decode engines answer the next good handoff."""
    prefill, decode, *_ = qwen
    blob = encode(make_image(640, 480, 25))
    (grid,) = _handoff(loop, prefill, "q-adm-0", [blob]).features.mm_grids["image"]
    bad = {
        PositionStateMissing: None,
        PositionStateMismatch: {"image": [Grid(t=1, h=grid.h, w=grid.w + MERGE)]},
    }
    for i, (error, grids) in enumerate(bad.items()):
        handoff = _with_grids(_handoff(loop, prefill, f"q-adm-{i + 1}", [blob]), grids)
        with pytest.raises(error):
            loop.run(collect(decode.generate(handoff)))
    good = _handoff(loop, prefill, "q-adm-good", [blob])
    tokens, last = loop.run(collect(decode.generate(good)))
    assert len(tokens) == 7 and last.stats.kv_tokens_pulled > 0

    # a model whose positions do not depend on the grid (the tiny LLaVA) refuses them
    llava_prefill, llava_decode = PrefillWorker(engines.prefill), DecodeWorker(engines.decode)
    handoff = _handoff(loop, llava_prefill, "q-adm-llava", [blob])
    assert handoff.features.mm_grids is None
    with pytest.raises(PositionStateUnexpected):
        llava_decode.admit(_with_grids(handoff, {"image": [grid]}))


def test_decode_fails_closed_without_kv_and_stays_healthy(loop, qwen):
    """A feature that carries the grid is still a KV-only one: with nothing to pull, the
    fail-closed scheduler ends the request instead of computing the image's positions."""
    from mmhandoff.engine.stream import KVCoverageError

    prefill, decode, *_ = qwen
    blob = encode(make_image(640, 480, 28))
    handoff = msgspec.structs.replace(_handoff(loop, prefill, "q-nokv", [blob]),
                                      kv_transfer_params={})
    with pytest.raises(KVCoverageError) as e:
        loop.run(collect(decode.generate(handoff)))
    assert e.value.cause.startswith("no KV")
    tokens, _ = loop.run(collect(decode.generate(_handoff(loop, prefill, "q-kv", [blob]))))
    assert len(tokens) == 7


def test_a_wrong_grid_of_the_same_size_changes_the_answer(loop, qwen):
    """Decode cannot check a grid against media it never sees: a signed handoff guards it (a
    changed grid fails the signature: test_handoff_message). Unsigned, a grid of the same token
    count is taken, and what it changes is documented here: positions after the image follow
    the grid's extent, so a grid with another extent changes the answer, while a transposed
    one (same extent, the same positions after the image) leaves it as it is."""
    prefill, decode, _, full_engine, *_ = qwen
    blob = encode(make_image(640, 480, 26))
    s = greedy(16, ignore_eos=True)
    agg = loop.run(agg_run(prefill, full_engine, "q-wrong-agg", _messages([blob]), s))
    (grid,) = _handoff(loop, prefill, "q-wrong-0", [blob]).features.mm_grids["image"]
    assert grid.h != grid.w
    flat = Grid(t=1, h=MERGE, w=grid.h * grid.w // MERGE)  # one row of tokens: a wider extent
    transposed = Grid(t=1, h=grid.w, w=grid.h)
    answers = {}
    for name, wrong in (("flat", flat), ("transposed", transposed)):
        handoff, _ = loop.run(prefill.handoff(PrefillRequest(
            request_id=f"q-wrong-{name}", messages=_messages([blob]), sampling=s)))
        handoff = _with_grids(handoff, {"image": [wrong]})
        tokens, _ = loop.run(collect(decode.generate(handoff)))
        answers[name] = [handoff.first_token, *tokens]
    assert answers["flat"] != agg
    assert answers["transposed"] == agg


def test_the_routers_block_hashes_are_the_engines(loop, qwen):
    """The router's hashes (vLLM's own function on the handoff's token ids and image
    identities: the grid needs no place in them) equal what prefill's and decode's engines
    published for the prompt, bit for bit."""
    _check_published_hashes(loop, qwen, "q-hashes",
                            _messages([encode(make_image(400, 600, 27))], "Hash me."))


def _check_published_hashes(loop, qwen, request_id, messages):
    """The handoff's prompt's block hashes, as BlockHasher computes them from the handoff, equal
    the chains prefill's and decode's engines published in their KV events."""
    import time

    from mmhandoff.vllm_adapter.block_hashes import BlockHasher
    from tests.flows import published_chain

    prefill, decode, _, _, prefill_events, decode_events = qwen
    _, _, h = loop.run(handoff_run(prefill, decode, request_id, messages, greedy(4)))
    assert len(h.token_ids) >= 64
    deadline = time.monotonic() + 10
    while None in (published_chain(prefill_events, h.token_ids),
                   published_chain(decode_events, h.token_ids)):
        assert time.monotonic() < deadline, "an engine published no KV events for the prompt"
        time.sleep(0.05)
    published = published_chain(prefill_events, h.token_ids)
    assert BlockHasher(32).of_handoff(h) == published
    assert published_chain(decode_events, h.token_ids) == published


def test_a_follow_up_bypass_takes_its_positions_from_the_grids(loop, qwen):
    """Prefill's bypass (docs/routing.md) for an M-RoPE model: the follow-up's handoff names no
    KV and carries each image's grid from prefill's render (no vision encoder run); decode
    computes every position from it and answers from its own prefix cache as agg does."""
    from tests.test_bypass_engine import _conversation

    first, follow_up = _conversation(64)
    _check_bypass(loop, qwen, "q-bp", first, follow_up, "image")


def _check_bypass(loop, qwen, request_id, first, follow_up, modality):
    """`first` through the handoff (decode then holds its blocks), then `follow_up` through
    prefill's bypass: no KV named, the item's grid carried, decode's answer from its own cache
    equal to agg's."""
    from tests.test_bypass_engine import BLOCK, Claims

    prefill, decode, _, full_engine, *_ = qwen
    s = greedy(12, ignore_eos=True)
    loop.run(handoff_run(prefill, decode, f"{request_id}-1", first, s))
    bypassing = PrefillWorker(prefill.engine, router=Claims(), bypass_max_tokens=256)
    answer = loop.run(bypassing.prefill(PrefillRequest(
        request_id=f"{request_id}-2", messages=follow_up, sampling=s)))
    handoff = decode_handoff(answer.handoff)
    assert answer.stats.bypassed and handoff.kv_transfer_params == {}
    ((kind, _, span, grid),) = handoff.items_with_grids()
    assert kind == modality and grid is not None
    assert span.offset + span.length <= len(handoff.token_ids) // BLOCK * BLOCK
    tokens, last = loop.run(collect(decode.generate(handoff)))
    assert tokens == loop.run(agg_run(prefill, full_engine, f"{request_id}-agg", follow_up, s))
    assert last.stats.kv_tokens_pulled == 0 and last.stats.kv_tokens_local > 0


# ---- video --------------------------------------------------------------------------------------
VIDEO_CASES = {  # (kind, (width, height, frames, fps, seed) | (width, height, seed))
    # 1 frame a second: the processor samples (Qwen2.5-VL: 2 s per step); 6 a second: the
    # loader samples at 2 (1 s per step)
    "video": [("video", (64, 48, 8, 1.0, 31))],
    "image-then-video": [("image", (320, 240, 32)), ("video", (96, 64, 12, 6.0, 33))],
}


def _media(case):
    return [(kind, make_video(*spec) if kind == "video" else encode(make_image(*spec)))
            for kind, spec in VIDEO_CASES[case]]


@pytest.mark.parametrize("case", list(VIDEO_CASES))
def test_video_parity_handoff_agg(loop, qwen, qwen_model, case):
    """A video's frames as vLLM's loader samples them for the model, rendered by prefill; decode
    gets its grid (and Qwen2.5-VL's seconds per step) and answers as the aggregated engine."""
    prefill, decode, _, full_engine, *_ = qwen
    parts = _media(case)
    messages = video_chat("What happens?", *parts)
    s = greedy(24, ignore_eos=True)
    tokens, last, handoff = loop.run(handoff_run(prefill, decode, f"qv-{case}", messages, s))
    agg = loop.run(agg_run(prefill, full_engine, f"qv-{case}", messages, s))
    assert len(agg) == 24 and tokens == agg
    assert last.stats.kv_tokens_pulled > 0
    ((grid,), (span,)) = (handoff.features.mm_grids["video"],
                          handoff.features.mm_placeholders["video"])
    embedded = span.length if span.is_embed is None else sum(span.is_embed)
    assert grid.t >= 2 and grid.t * grid.h * grid.w // MERGE ** 2 == embedded
    assert (grid.seconds is not None) == ("qwen2-5-vl" in Path(qwen_model).name)
    assert last.stats.request_bytes < 4096  # metadata, never the video (its type holds none)


def _video_request(request_id, blob, sampling, text="What happens?"):
    return PrefillRequest(request_id=request_id, messages=video_chat(text, ("video", blob)),
                          sampling=sampling)


def test_video_vllm_greedy_equals_transformers(loop, qwen, qwen_model):
    """transformers' processor and model, given the frames vLLM's loader sampled and their
    metadata, answer as the aggregated engine, and compute the grid (and seconds per step) the
    handoff carries. (The clip's frames are wider, in merged tokens, than its temporal extent:
    transformers 5.17 places the text after a Qwen2.5-VL video max(h, w) / merge positions past
    the video's start, where vLLM, and transformers as Qwen2.5-VL was released, go on after the
    video's last position, its temporal one included; the two agree on such a clip only.)"""
    import torch
    from transformers import AutoModelForImageTextToText, AutoProcessor

    prefill, _, _, full_engine, *_ = qwen
    s = greedy(16, ignore_eos=True)
    request = _video_request("qv-hf", make_video(160, 120, 8, 4.0, 34), s)
    ours = loop.run(agg_run(prefill, full_engine, "qv-hf", request.messages, s))
    (video,) = loop.run(prefill.prompts.media(request, decode=True))
    frames, metadata = video.video
    assert not metadata["do_sample_frames"]  # sampled by the loader: transformers takes them
    processor = AutoProcessor.from_pretrained(qwen_model)
    model = AutoModelForImageTextToText.from_pretrained(qwen_model, dtype=torch.float32)
    given = {k: v for k, v in metadata.items() if k not in ("do_sample_frames", "video_backend")}
    inputs = processor(text=[prefill.prompts.text(request)], videos=[frames],
                       video_metadata=[given], do_sample_frames=False, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=16, do_sample=False)
    assert out[0, inputs["input_ids"].shape[1]:].tolist() == ours
    handoff, _ = loop.run(prefill.handoff(request))
    (grid,) = handoff.features.mm_grids["video"]
    assert [grid.t, grid.h, grid.w] == inputs["video_grid_thw"][0].tolist()
    seconds = inputs.get("second_per_grid_ts")
    assert grid.seconds == (None if seconds is None else float(seconds[0]))
    assert handoff.token_ids == inputs["input_ids"][0].tolist()


def test_video_position_state_admission_on_the_engines(loop, qwen):
    """A video grid that does not match its span, and seconds per step where the model reads
    none (or none where it does), are refused with their typed error before the engine sees
    them; decode answers the next good handoff."""
    prefill, decode, *_ = qwen
    s = greedy(8, ignore_eos=True)
    blob = make_video(64, 48, 8, 4.0, 35)

    def handoff(i):
        return loop.run(prefill.handoff(_video_request(f"qv-adm-{i}", blob, s)))[0]

    (grid,) = handoff(0).features.mm_grids["video"]
    other_seconds = None if grid.seconds is not None else 1.0
    bad = [msgspec.structs.replace(grid, t=grid.t + 1),
           msgspec.structs.replace(grid, w=grid.w + MERGE),
           msgspec.structs.replace(grid, seconds=other_seconds)]
    for i, wrong in enumerate(bad, 1):
        with pytest.raises(PositionStateMismatch):
            loop.run(collect(decode.generate(_with_grids(handoff(i), {"video": [wrong]}))))
    tokens, last = loop.run(collect(decode.generate(handoff("good"))))
    assert len(tokens) == 7 and last.stats.kv_tokens_pulled > 0


def test_a_video_sent_again_goes_by_its_hash_and_keeps_its_grid(loop, qwen):
    """A follow-up turn with the same video: prefill's memo skips decoding it (vLLM's processed
    cache has it), its grid comes from prefill's memo, the answer is the same."""
    prefill, decode, *_ = qwen
    s = greedy(12, ignore_eos=True)
    blob = make_video(96, 64, 12, 6.0, 36)
    runs = []
    for i in range(2):
        request = _video_request(f"qv-again-{i}", blob, s)
        (video,) = loop.run(prefill.prompts.media(request))
        runs.append((video.video is None, *loop.run(
            handoff_run(prefill, decode, request.request_id, request.messages, s))[::2]))
    (first_bare, tokens0, h0), (again_bare, tokens1, h1) = runs
    assert not first_bare and again_bare
    assert tokens0 == tokens1 and h0.features.mm_grids == h1.features.mm_grids
    assert h0.features.mm_hashes == h1.features.mm_hashes


def test_a_video_prompts_block_hashes_are_the_engines(loop, qwen):
    """The router's hashes of a prompt with a video (its identity in every block it spans)
    equal what prefill's and decode's engines published."""
    _check_published_hashes(loop, qwen, "qv-hashes", video_chat(
        "Hash this clip, frame by frame, with its text.",
        ("video", make_video(128, 96, 32, 8.0, 37))))


def test_a_model_without_video_refuses_one_with_a_typed_error(loop, engines):
    """The tiny LLaVA takes images only: a video is the client's error (4xx), not a crash,
    and the engine answers the next request."""
    from mmhandoff.prefill.worker import ERRORS

    llava = PrefillWorker(engines.prefill)
    request = _video_request("qv-llava", make_video(64, 48, 8, 4.0, 38), greedy(4))
    with pytest.raises(ERRORS) as e:
        loop.run(llava.handoff(request))
    assert e.value.fault == "client" and e.value.code == "invalid_request", e.value
    handoff, _ = loop.run(llava.handoff(PrefillRequest(
        request_id="qv-llava-image", messages=_messages([encode(make_image(64, 64, 39))]),
        sampling=greedy(4))))
    assert handoff.features.mm_hashes["image"]


def test_a_follow_up_about_the_same_video_bypasses_prefill(loop, qwen):
    """Prefill's bypass (docs/routing.md) for a follow-up turn about a video: the handoff names
    no KV and carries the video's grid (and seconds) from prefill's render; decode answers from
    its own prefix cache as agg does."""
    from mmhandoff.wire.messages import ChatMessage

    first = video_chat("What happens in this clip, frame by frame?",
                       ("video", make_video(96, 64, 12, 6.0, 40)))
    follow_up = [*first, ChatMessage("assistant", "A square moves."),
                 ChatMessage("user", "Tell me more.")]
    _check_bypass(loop, qwen, "qv-bp", first, follow_up, "video")
