"""PromptBuilder's memo of decoded data URIs (engine.prompt): an image sent again as the same data
URI is not decoded again, goes to the engine without pixels, and renders exactly as its decode
did; an engine that no longer holds it gets it decoded. On the FakeEngine, which keeps a set of
processed images as vLLM's processor cache does (the engine tier checks vLLM itself:
tests/test_bypass_engine.py)."""

from __future__ import annotations

import asyncio

import pytest

import mmhandoff.engine.prompt as prompt_module
from mmhandoff.engine import PixelsNeeded
from mmhandoff.engine.fake import FakeEngine
from mmhandoff.engine.prompt import PromptBuilder
from mmhandoff.media.images import ImageError, decode_image
from mmhandoff.wire.messages import PrefillRequest
from tests.conftest import chat, data_uri, encode, make_image

pytestmark = pytest.mark.unit


def _request(*uris: str) -> PrefillRequest:
    return PrefillRequest(request_id="memo", messages=chat("What is in it?", *uris))


def _render(builder: PromptBuilder, request: PrefillRequest):
    async def run():
        images = await builder.media(request)
        return images, await builder.render(request, images)
    return asyncio.run(run())


def test_a_data_uri_sent_again_is_not_decoded_and_renders_as_its_decode_did():
    builder = PromptBuilder(FakeEngine(role="prefill"))
    image = make_image(64, 48, 5)
    request = _request(data_uri(encode(image)))
    first, rendered = _render(builder, request)
    again, rendered_again = _render(builder, request)
    assert first[0].image is not None and again[0].image is None
    expected = decode_image(encode(image))  # the content hash, independently of the memo
    assert again[0].content_hash == first[0].content_hash == expected.content_hash
    assert again[0].source_bytes == first[0].source_bytes == expected.source_bytes
    assert (rendered_again.token_ids, rendered_again.features) == (rendered.token_ids,
                                                                   rendered.features)


def test_the_same_pixels_in_other_bytes_are_decoded_and_get_the_same_identity():
    builder = PromptBuilder(FakeEngine(role="prefill"))
    image = make_image(64, 48, 6)
    png, bmp = data_uri(encode(image)), data_uri(encode(image, "BMP"), "image/bmp")
    (a,), _ = _render(builder, _request(png))
    (b,), _ = _render(builder, _request(bmp))
    assert b.image is not None and b.content_hash == a.content_hash


def test_an_image_the_engine_no_longer_holds_is_decoded_and_rendered_again():
    engine = FakeEngine(role="prefill")
    builder = PromptBuilder(engine)
    request = _request(data_uri(encode(make_image(64, 48, 7))))
    _, rendered = _render(builder, request)
    engine.processed.clear()  # evicted from the engine's cache of processed images
    bare = asyncio.run(builder.media(request))
    with pytest.raises(PixelsNeeded):  # the engine's own refusal, which render handles
        asyncio.run(engine.render(builder.text(request), bare))
    assert asyncio.run(builder.render(request, bare)).token_ids == rendered.token_ids
    assert engine.processed  # sent with its pixels this time


def test_the_memo_is_bounded_and_a_bad_image_is_not_remembered(monkeypatch):
    monkeypatch.setattr(prompt_module, "DECODED_MEMO", 2)
    builder = PromptBuilder(FakeEngine(role="prefill"))
    uris = [data_uri(encode(make_image(32, 32, seed))) for seed in (1, 2, 3)]
    for uri in uris:
        _render(builder, _request(uri))
    (oldest,), _ = _render(builder, _request(uris[0]))  # pushed out by the third
    (newest,), _ = _render(builder, _request(uris[2]))
    assert oldest.image is not None and newest.image is None
    bad = "data:image/png;base64," + "A" * 64
    for _ in range(2):  # refused each time: never remembered as good
        with pytest.raises(ImageError):
            asyncio.run(builder.media(_request(bad)))


def test_a_local_file_is_decoded_each_time(tmp_path):
    """A file's contents may change between requests: only data URIs are remembered."""
    path = tmp_path / "picture.png"
    path.write_bytes(encode(make_image(32, 32, 4)))
    builder = PromptBuilder(FakeEngine(role="prefill"))
    for _ in range(2):
        (image,), _ = _render(builder, _request(str(path)))
        assert image.image is not None


def test_a_requests_images_are_prepared_side_by_side_in_prompt_order(monkeypatch):
    """Each image is loaded in its own worker thread: two loads that wait for each other (a
    barrier of two) finish only if they run at the same time. The images keep their order."""
    import threading

    meet = threading.Barrier(2, timeout=30)
    load = prompt_module.load_image_ref

    def side_by_side(ref, limits, draft):
        meet.wait()  # raises BrokenBarrierError if the other load never starts
        return load(ref, limits, draft)

    monkeypatch.setattr(prompt_module, "load_image_ref", side_by_side)
    images = [make_image(64, 48, 7), make_image(48, 64, 8)]
    loaded, _ = _render(PromptBuilder(FakeEngine(role="prefill")),
                        _request(*(data_uri(encode(i)) for i in images)))
    assert [i.content_hash for i in loaded] == [decode_image(encode(i)).content_hash
                                                 for i in images]


def test_a_draft_decode_needs_a_processor_that_allows_it():
    """The fake engine has no presizer: "draft" decodes exactly (and says so in the log); an
    unknown mode is refused."""
    builder = PromptBuilder(FakeEngine(role="prefill"), image_decode="draft")
    builder.start()
    assert builder.draft is None
    image = make_image(1600, 1200, 6)
    (loaded,), _ = _render(builder, _request(data_uri(encode(image, "JPEG"), "image/jpeg")))
    assert loaded.image.size == (1600, 1200)
    with pytest.raises(ValueError, match="image_decode"):
        PromptBuilder(FakeEngine(), image_decode="fast")
