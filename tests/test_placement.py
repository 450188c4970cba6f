"""Prefill placement without engines: the frontend's image keys (frontend.placement), what prefill
publishes about them (prefill.prefixes, through its kv_blocks feed), the router's table of them
(router.prefix_table), router.place, and the frontend's fallback to round robin when the router
is no help."""

from __future__ import annotations

import asyncio

import msgspec
import pytest

from mmhandoff.frontend.placement import PrefillPlacement, image_keys
from mmhandoff.prefill.prefixes import image_ends, prefix_blocks
from mmhandoff.router.prefix_table import PrefixTable
from mmhandoff.router.router import Router
from mmhandoff.wire.handoff import Features, Span
from mmhandoff.wire.messages import (
    ChatMessage,
    Placement,
    PlaceRequest,
    PrefillRequest,
    TextPart,
    user,
)

pytestmark = pytest.mark.unit

BLOCK = 4
A, B = "data:image/png;base64,QUFB", "data:image/png;base64,QkJC"


def _chat(*messages, salt=None) -> PrefillRequest:
    return PrefillRequest(request_id="r", messages=list(messages), cache_salt=salt)


def test_an_images_key_covers_what_comes_before_its_end_and_nothing_after():
    first = image_keys(_chat(user("what is it?", A)))
    assert len(first) == 1 and first == image_keys(_chat(user("what is it?", A)))
    # what follows the image changes nothing before it: a follow-up turn keeps its key
    follow_up = _chat(user("what is it?", A), ChatMessage("assistant", "a cat"),
                      user("and its colour?"))
    assert image_keys(follow_up) == first
    assert image_keys(_chat(user("something else", A))) == first  # the text comes after it
    # what comes before it does
    assert image_keys(_chat(user("what is it?", B))) != first  # other bytes
    assert image_keys(_chat(user("what is it?", A), salt="tenant-1")) != first
    assert image_keys(_chat(ChatMessage("system", "be brief"), user("what is it?", A))) != first
    two = image_keys(_chat(user("compare", A, B)))
    assert len(two) == 2 and two[0] == first[0] and two[1] != first[0]
    swapped = image_keys(_chat(user("compare", B, A)))
    assert set(swapped).isdisjoint(two)  # order is part of a prefix
    assert image_keys(PrefillRequest(request_id="r", prompt="no chat, no images")) == []


def test_a_video_has_its_key_as_an_image_has():
    """One key per image or video, in prompt order; a video's key is of its bytes, and a video
    never shares a key with an image of the same data URI body."""
    from mmhandoff.wire.messages import (
        ChatMessage,
        ImagePart,
        ImageURL,
        TextPart,
        VideoPart,
        VideoURL,
    )

    def turn(*parts):
        return _chat(ChatMessage("user", [*parts, TextPart("what happens?")]))

    clip, other = VideoPart(VideoURL("data:video/mp4;base64,AAAA")), VideoPart(VideoURL(
        "data:video/mp4;base64,BBBB"))
    (key,) = image_keys(turn(clip))
    assert image_keys(turn(clip)) == [key] and image_keys(turn(other)) != [key]
    assert image_keys(turn(ImagePart(ImageURL("data:video/mp4;base64,AAAA")))) != [key]
    both = image_keys(turn(ImagePart(ImageURL(A)), clip))
    assert len(both) == 2 and both[0] == image_keys(turn(ImagePart(ImageURL(A))))[0]


def test_text_parts_are_delimited_so_that_moving_a_boundary_changes_the_key():
    def key(*texts):
        parts = [TextPart(t) for t in texts]
        return image_keys(_chat(ChatMessage("user", [*parts, *user("", A).content[:1]])))

    assert key("ab", "c") != key("a", "bc")


def _features(spans: list[tuple[int, int]]) -> Features:
    return Features(mm_hashes={"image": [f"img-{i}" for i in range(len(spans))]},
                    mm_placeholders={"image": [Span(offset=o, length=n) for o, n in spans]})


def test_prefill_publishes_the_full_blocks_through_each_image():
    hashes = list(range(100, 110))  # 10 full blocks of 4 tokens
    # the spans come in any order: keys follow the prompt's
    features = Features(mm_hashes={"image": ["b", "a"]}, mm_placeholders={
        "image": [Span(offset=13, length=14), Span(offset=2, length=8)]})
    assert prefix_blocks(["k1", "k2"], image_ends(features), hashes, BLOCK) == {
        "k1": [100, 101],  # the first image ends at token 10: blocks 0-1 are full
        "k2": list(range(100, 106))}  # the second at 27: blocks 0-5
    assert prefix_blocks(["k1"], image_ends(features), hashes, BLOCK) == {}  # keys != images
    assert prefix_blocks(["k"], image_ends(_features([(0, 3)])), hashes, BLOCK) == {}  # no full


def test_the_table_keeps_the_deepest_known_prefix_and_forgets_the_oldest_first():
    t = PrefixTable(max_keys=2)
    t.update({"a": [1, 2], "b": [1, 2, 3]})
    assert t.deepest(["a", "b"]) == (1, 2, 3) and t.deepest(["a", "unknown"]) == (1, 2)
    assert t.deepest(["unknown"]) == ()
    assert t.deepest(["a"])  # used: b is now the oldest
    t.update({"c": [7]})
    assert len(t) == 2 and t.deepest(["b"]) == () and t.deepest(["a"]) == (1, 2)


class _Instances:
    def __init__(self, ids):
        self.ids = ids

    def instance_ids(self):
        return list(self.ids)


@pytest.fixture(scope="module")
def hasher():
    from mmhandoff.vllm_adapter.block_hashes import BlockHasher

    return BlockHasher(BLOCK)


def test_place_sends_a_known_prefix_to_the_prefill_replica_holding_its_blocks(hasher):
    r = Router(_Instances([1, 2]), prefill=_Instances([10, 20, 30]), hasher=hasher)
    ask = PlaceRequest(request_id="r", image_keys=["k1"])
    # nothing learned yet: load decides, from what the prefill workers publish
    r.prefill.loads.update({10: 2, 20: 0, 30: 1})
    assert r.place(ask) == Placement(instance=20, reason="load")
    r.table.update({"k1": [7, 8]})  # a prefill worker said what k1 is in blocks
    r.prefill.index.stored(30, [7, 8, 9])  # what prefill 30's engine says it holds
    r.prefill.index.stored(10, [7])
    assert r.place(ask) == Placement(instance=30, reason="overlap", blocks_held=2, blocks=2)
    r.prefill.index.removed(30, [7])  # evicted: not a prefix any more
    assert r.place(ask) == Placement(instance=10, reason="overlap", blocks_held=1, blocks=2)
    r.prefill.index.removed(10, [7])
    assert r.place(ask).reason == "load"


def test_place_leaves_it_to_round_robin_when_there_is_nothing_to_choose(hasher):
    ask = PlaceRequest(request_id="r", image_keys=["k1"])
    assert Router(_Instances([1]), prefill=_Instances([10]), hasher=hasher).place(ask) \
        == Placement()
    assert Router(_Instances([1]), prefill=_Instances([10, 20]), hasher=hasher,
                  policy="round_robin").place(ask) == Placement()
    assert Router(_Instances([1]), prefill=_Instances([10, 20]), hasher=hasher).place(
        PlaceRequest(request_id="r")) == Placement()  # no image: nothing to find
    assert Router(_Instances([1]), hasher=hasher).place(ask) == Placement()  # no prefill tier


class _Annotated:
    def __init__(self, item):
        self.item = item

    def data(self):
        return self.item


def test_a_malformed_place_request_is_answered_with_round_robin(hasher):
    r = Router(_Instances([1]), prefill=_Instances([10, 20]), hasher=hasher)

    async def ask(request):
        return [item async for item in r.handle_place(request)]

    assert asyncio.run(ask({"image_keys": 5})) == [msgspec.to_builtins(Placement())]


class _Place:
    """A Dynamo client of router.place whose first `fail` calls fail at once."""

    def __init__(self, answer=None, delay_s=0.0, fail=0):
        self.answer, self.delay_s, self.fail, self.calls = answer, delay_s, fail, 0

    async def round_robin(self, request, context=None):
        self.calls += 1
        failing = self.calls <= self.fail

        async def stream():
            await asyncio.sleep(self.delay_s)
            if failing:
                raise RuntimeError("no responders")
            yield _Annotated(msgspec.to_builtins(self.answer))
        return stream()


def test_the_frontend_goes_round_robin_when_the_router_is_no_help():
    request = _chat(user("what is it?", A))
    keys = image_keys(request)
    prefill = _Instances([10, 20])

    def instance(place, keys=keys):
        return asyncio.run(PrefillPlacement(place, prefill, timeout_s=0.2).instance(request, keys))

    assert instance(_Place(Placement(instance=20, reason="overlap"))) == 20
    # a killed router instance still in discovery: the next one answers
    assert instance(_Place(Placement(instance=20, reason="overlap"), fail=1)) == 20
    assert instance(_Place(Placement(instance=20), delay_s=5)) is None  # too slow
    assert instance(_Place(fail=2)) is None  # away
    assert instance(_Place(Placement(instance=99, reason="load"))) is None  # gone meanwhile
    assert instance(_Place(Placement(instance=20)), keys=[]) is None  # nothing to ask about
    prefill.ids = [20]  # one replica: nothing to choose, nothing asked
    assert instance(_Place(fail=2)) is None


def test_what_prefill_publishes_reaches_a_routers_table_through_the_feed(loop):
    """Prefill (fake engine) computes a request with image keys; its kv_blocks feed carries the
    prefixes, also in a later caller's snapshot; a follower puts them in the router's table,
    where they equal the engine's own block hashes through the image."""
    from mmhandoff.engine.fake import FakeEngine
    from mmhandoff.prefill.worker import PrefillWorker
    from mmhandoff.process.block_feed import BlockFeed
    from mmhandoff.router.follow import Follower
    from mmhandoff.router.tier import Tier
    from tests.conftest import data_uri, encode, make_image

    engine = FakeEngine(role="prefill")
    worker = PrefillWorker(engine)
    feed = BlockFeed(block_size=engine.block_size)
    worker.publish_prefixes = feed.prefixes
    uri = data_uri(encode(make_image(32, 32, 1)))
    request = _chat(user("what is it in this picture?", uri))
    request = msgspec.structs.replace(request, image_keys=image_keys(request))

    async def scenario():
        answer = await worker.prefill(request)
        rendered = await engine.render(worker.prompts.text(request),
                                       await worker.prompts.media(request))
        table = PrefixTable()
        follower = Follower(_FeedClient(feed), Tier("prefill"), engine.block_size,
                            on_prefixes=table.update)
        follower.sync({7})
        for _ in range(20):
            await asyncio.sleep(0)
        follower.sync(set())
        return answer, rendered, table

    answer, rendered, table = loop.run(scenario())
    assert answer.handoff is not None
    (span,) = rendered.features.mm_placeholders["image"]
    end = span.offset + span.length
    expected = engine.block_hashes(rendered, None, upto=end)
    assert len(expected) == end // engine.block_size > 0
    assert table.deepest(request.image_keys) == tuple(expected)


class _FeedClient:
    """A Dynamo client of one worker's kv_blocks endpoint, in process."""

    def __init__(self, feed):
        self.feed = feed

    def instance_ids(self):
        return [7]

    async def direct(self, request, instance_id, context=None):
        async def stream():
            async for item in self.feed.handle(request):
                yield _Annotated(item)
        return stream()
