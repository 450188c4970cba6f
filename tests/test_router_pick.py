"""The KV-aware router's parts without engines: the scorers' formulas, the choice (router.pick),
the workers' block feed (process.block_feed) and the router's follower of it (router.follow)."""

from __future__ import annotations

import asyncio

import msgspec
import pytest

from mmhandoff.process import block_feed
from mmhandoff.process.block_feed import BlockFeed
from mmhandoff.router.follow import Follower
from mmhandoff.router.router import Router
from mmhandoff.router.scorers import Candidates
from mmhandoff.router.scorers.load import LoadScorer
from mmhandoff.router.scorers.overlap import OverlapScorer
from mmhandoff.router.tier import Tier
from mmhandoff.wire.handoff import (
    VERSION,
    BlockHashes,
    Features,
    Handoff,
    Sampling,
    Span,
    decode_handoff,
    encode_handoff,
    sign,
)
from mmhandoff.wire.messages import HandoffMessage, KvBlocks, KvHeld, handoff_bytes

pytestmark = pytest.mark.unit

BLOCK = 4


def test_overlap_score_is_the_share_of_the_prompts_blocks_held():
    c = Candidates([1, 2, 3], overlap={1: 3, 2: 1}, blocks=4)
    assert OverlapScorer().score(c) == {1: 0.75, 2: 0.25, 3: 0.0}
    assert OverlapScorer().score(Candidates([1, 2], blocks=0)) == {1: 0.0, 2: 0.0}


def test_kv_usage_score_is_the_free_share_of_the_kv_cache():
    from mmhandoff.router.scorers.kv_usage import KvUsageScorer

    c = Candidates([1, 2, 3], kv_usage={1: 0.25, 2: 1.0})
    assert KvUsageScorer().score(c) == {1: 0.75, 2: 0.0, 3: 1.0}  # 3: not heard from yet


def test_load_score_prefers_the_idle_and_never_rules_one_out():
    c = Candidates([1, 2, 3], in_flight={1: 3, 2: 1})
    assert LoadScorer().score(c) == {1: 1 - 3 / 4, 2: 1 - 1 / 4, 3: 1.0}
    assert LoadScorer().score(Candidates([1, 2])) == {1: 1.0, 2: 1.0}


class _Instances:
    def __init__(self, ids):
        self.ids = ids

    def instance_ids(self):
        return list(self.ids)


def _handoff(tokens: list[int], image: str | None = "img-a", bypass: bool = False) -> dict:
    """A handoff naming KV to pull from prefill, or (`bypass`) none: prefill's bypass."""
    spans = {"image": [Span(offset=2, length=8)]} if image else {}
    h = Handoff(v=1, request_id="r", model_fingerprint="f", token_ids=tokens,
                features=Features(mm_hashes={"image": [image]} if image else {},
                                  mm_placeholders=spans),
                requires_kv=True, sampling=Sampling(),
                kv_transfer_params={} if bypass else {"do_remote_prefill": True})
    return _message(h)


def _message(h: Handoff) -> dict:
    """The router's message for `h` as Dynamo delivers it: its bytes, in base64 text."""
    return msgspec.to_builtins(HandoffMessage(encode_handoff(h)))


def _typed(message: dict) -> Handoff:
    return decode_handoff(handoff_bytes(message))


@pytest.fixture(scope="module")
def hasher():
    from mmhandoff.vllm_adapter.block_hashes import BlockHasher

    return BlockHasher(BLOCK)


def _router(hasher, ids=(10, 20, 30), **kw) -> Router:
    return Router(_Instances(ids), hasher=hasher, **kw)


def _blocks(router, handoff: dict) -> list:
    return router.hasher.of_handoff(_typed(handoff))


def test_the_replica_holding_the_longest_prefix_wins(hasher):
    r = _router(hasher)
    h = _handoff(list(range(100, 121)))  # 21 tokens: 5 full blocks
    blocks = _blocks(r, h)
    r.decode.index.stored(20, blocks[:2])
    r.decode.index.stored(30, blocks[:4])
    assert r.pick(h) == (30, "overlap")
    r.decode.index.stored(10, blocks)
    assert r.pick(h) == (10, "overlap")


def test_the_same_tokens_with_another_image_are_other_blocks(hasher):
    r = _router(hasher)
    h = _handoff(list(range(100, 121)))
    r.decode.index.stored(30, _blocks(r, h))
    other = _handoff(list(range(100, 121)), image="img-b")  # the image starts in block 0
    assert r.decode.index.overlap(_blocks(r, other))[30] == 0
    assert r.pick(other)[1] == "load"


def test_an_authentic_handoffs_own_hashes_are_looked_up_any_other_is_hashed_again(hasher):
    """Prefill's hashes (here made up, so that a hit can only come from them) are used when
    the handoff verifies with the router's keys and has the router's block size."""
    key = b"k" * 32
    plain = _handoff(list(range(100, 121)))  # 5 full blocks
    carried = BlockHashes(block_size=BLOCK, hashes=[7, 8, 9, 10, 11])
    h = msgspec.structs.replace(_typed(plain), v=VERSION, block_hashes=carried)
    signed_h = sign(h, key, ttl_s=30)
    signed = _message(signed_h)
    r = _router(hasher, keys=[key])
    r.decode.index.stored(30, carried.hashes)
    assert r.pick(signed) == (30, "overlap") and r.hashed_by == {"prefill": 1}
    tampered = _message(msgspec.structs.replace(
        signed_h, block_hashes=BlockHashes(block_size=BLOCK, hashes=[7, 8, 9, 10, 12])))
    unsigned = _message(h)
    resized = _message(sign(msgspec.structs.replace(
        h, block_hashes=BlockHashes(block_size=2 * BLOCK, hashes=[1, 2])), key, ttl_s=30))
    for other in (tampered, unsigned, resized):
        assert r.pick(other)[1] == "load"  # the made-up hashes were not looked up
    assert r.hashed_by == {"prefill": 1, "router": 3}
    # a router without keys (an unsigned plane) takes an unsigned handoff's hashes
    unkeyed = _router(hasher)
    unkeyed.decode.index.stored(20, carried.hashes)
    assert unkeyed.pick(unsigned) == (20, "overlap")
    assert unkeyed.pick(signed)[1] == "load"  # signed with a key it does not have


def test_with_nothing_held_load_decides_then_turns(hasher):
    r = _router(hasher)
    h = _handoff(list(range(50, 70)))
    r.in_flight.update({10: 2, 20: 1})
    assert r.pick(h) == (30, "load")
    r.in_flight[30] = 1
    picks = [r.pick(h)[0] for _ in range(4)]  # 20 and 30 tie: they take turns
    assert sorted(picks) == [20, 20, 30, 30]


def test_load_counts_what_the_workers_publish_when_it_is_more(hasher):
    """Another router's requests show only in what the worker published."""
    r = _router(hasher)
    h = _handoff(list(range(50, 70)))
    r.decode.loads.update({10: 3, 20: 1, 30: 2})  # as the workers last published
    r.in_flight.update({20: 4})  # this router's own streams: more than 20 published
    assert r.pick(h) == (30, "load")


def test_kv_usage_weighs_when_the_yaml_gives_it_a_weight(hasher):
    h = _handoff(list(range(50, 70)))
    r = _router(hasher, weights={"overlap": 1, "kv_usage": 0.5})
    r.decode.kv_usage.update({10: 0.9, 20: 0.2, 30: 0.5})
    assert r.pick(h) == (20, "load")  # nothing held: the emptiest KV cache


def test_load_breaks_a_tie_in_overlap(hasher):
    r = _router(hasher)
    h = _handoff(list(range(100, 121)))
    for instance in (10, 20):
        r.decode.index.stored(instance, _blocks(r, h))
    r.in_flight[10] = 3
    assert r.pick(h) == (20, "overlap")


def test_a_bypassed_handoff_goes_where_its_blocks_are_whatever_the_load(hasher):
    """It names no KV to pull: only a replica holding its blocks can answer it."""
    r = _router(hasher, weights={"overlap": 1, "load": 10})
    h = _handoff(list(range(100, 121)), bypass=True)
    r.decode.index.stored(20, _blocks(r, h)[:3])
    r.decode.index.stored(30, _blocks(r, h)[:2])
    r.in_flight.update({20: 5})
    assert r.pick(h) == (20, "bypass")
    pulled = _handoff(list(range(100, 121)))  # the same prompt with KV to pull: load weighs
    assert r.pick(pulled) == (30, "overlap")


def test_held_names_the_replica_with_the_most_leading_blocks(hasher):
    r = _router(hasher)
    h = _handoff(list(range(100, 121)), bypass=True)  # 5 full blocks
    blocks = _blocks(r, h)
    assert r.held(h) == KvHeld(instance=None, blocks_held=0, blocks=5)
    r.decode.index.stored(10, blocks[1:])  # not a prefix: no use
    r.decode.index.stored(30, blocks[:3])
    assert r.held(h) == KvHeld(instance=30, blocks_held=3, blocks=5)
    assert _router(hasher, policy="round_robin").held(h) == KvHeld()
    assert r.held({"v": 1, "token_ids": "x"}) == KvHeld()


def test_the_random_policy_picks_every_live_replica_whatever_it_holds(hasher):
    """The benchmarks' second baseline: a seeded uniform choice, on both tiers."""
    from mmhandoff.wire.messages import PlaceRequest

    r = _router(hasher, policy="random")
    r.prefill.client = _Instances([1, 2])
    h = _handoff(list(range(100, 121)))
    r.decode.index.stored(30, _blocks(r, h))  # ignored
    picks = [r.pick(h) for _ in range(40)]
    assert {reason for _, reason in picks} == {"random"}
    assert {i for i, _ in picks} == {10, 20, 30}
    placed = [r.place(PlaceRequest(request_id="r", image_keys=["k"])) for _ in range(20)]
    assert {p.instance for p in placed} == {1, 2} and {p.reason for p in placed} == {"random"}
    again = _router(hasher, policy="random")
    assert [again.pick(h) for _ in range(40)] == picks  # seeded: the same choices each run


def test_round_robin_policy_one_replica_and_an_unreadable_handoff_leave_it_to_dynamo(hasher):
    assert _router(hasher, policy="round_robin").pick(_handoff([1] * 9)) == (None, "round_robin")
    assert _router(hasher, ids=(10,)).pick(_handoff([1] * 9)) == (None, "round_robin")
    assert _router(hasher).pick({"v": 1, "token_ids": "x"}) == (None, "unparsed")


def test_bad_configuration_is_refused():
    with pytest.raises(ValueError, match="policy"):
        Router(_Instances([1]), policy="fastest")
    with pytest.raises(ValueError, match="scorers"):
        Router(_Instances([1]), weights={"overlap": 1, "luck": 1})


def _drain(loop, agen, n):
    async def take():
        return [await anext(agen) for _ in range(n)]

    return loop.run_until_complete(take())


def test_a_feed_gives_a_snapshot_then_each_change_in_order():
    loop = asyncio.new_event_loop()
    try:
        feed = BlockFeed(block_size=32)
        feed.apply([("stored", [1, 2, 3])])
        early = feed.handle({})
        (snap,) = _drain(loop, early, 1)
        assert msgspec.convert(snap, KvBlocks) == KvBlocks(kind="snapshot", hashes=[1, 2, 3],
                                                           block_size=32)
        feed.apply([("removed", [2]), ("stored", [4]), ("cleared", [])])
        feed.load(running=2, waiting=1, kv_usage=0.5)
        feed.load(running=2, waiting=1, kv_usage=0.6)  # the same requests: nothing sent
        feed.apply([("stored", [5])])
        items = [msgspec.convert(i, KvBlocks) for i in _drain(loop, early, 5)]
        assert [(i.kind, i.hashes) for i in items] == [
            ("removed", [2]), ("stored", [4]), ("cleared", []), ("load", []), ("stored", [5])]
        assert (items[3].running, items[3].waiting, items[3].kv_usage) == (2, 1, 0.5)
        feed.prefixes({"k": [4, 5]})
        late = feed.handle({})
        (snap,) = _drain(loop, late, 1)  # a late caller gets the state now, in one message
        assert msgspec.convert(snap, KvBlocks) == KvBlocks(
            kind="snapshot", hashes=[5], block_size=32, running=2, waiting=1, kv_usage=0.5,
            prefixes={"k": [4, 5]})
        assert _drain(loop, early, 1)[0] == {"kind": "prefixes", "prefixes": {"k": [4, 5]}}
        feed.close()  # a stopping worker ends every stream
        for stream in (early, late):
            with pytest.raises(StopAsyncIteration):
                _drain(loop, stream, 1)
    finally:
        loop.close()


def test_a_caller_that_falls_behind_is_cut_off_not_buffered(monkeypatch):
    monkeypatch.setattr(block_feed, "MAX_BEHIND", 3)
    loop = asyncio.new_event_loop()
    try:
        feed = BlockFeed(block_size=32)
        slow = feed.handle({})
        _drain(loop, slow, 1)
        for i in range(5):
            feed.apply([("stored", [i])])
        assert len(_drain(loop, slow, 3)) == 3
        with pytest.raises(StopAsyncIteration):  # it calls again for a fresh snapshot
            _drain(loop, slow, 1)
    finally:
        loop.close()


class _Annotated:
    def __init__(self, item):
        self.item = item

    def data(self):
        return self.item


class _Feeds:
    """A Dynamo client of kv_blocks: each instance's stream is a queue the test fills."""

    def __init__(self):
        self.live: set[int] = set()
        self.queues: dict[int, asyncio.Queue] = {}
        self.calls: list[int] = []

    def instance_ids(self):
        return sorted(self.live)

    async def direct(self, request, instance_id, context=None):
        self.calls.append(instance_id)
        q = self.queues.setdefault(instance_id, asyncio.Queue())

        async def stream():
            while (item := await q.get()) is not None:
                yield _Annotated(item)

        return stream()

    def send(self, instance, kind, hashes=(), block_size=0, **load):
        self.queues.setdefault(instance, asyncio.Queue()).put_nowait(msgspec.to_builtins(
            KvBlocks(kind=kind, hashes=list(hashes), block_size=block_size, **load)))


def test_the_follower_mirrors_each_instance_and_resyncs_after_a_broken_stream():
    async def scenario():
        feeds, tier = _Feeds(), Tier("decode")
        index = tier.index
        f = Follower(feeds, tier, block_size=32)

        async def settle():
            for _ in range(20):
                await asyncio.sleep(0)

        feeds.live = {1, 2}
        feeds.send(1, "snapshot", [11, 12], 32)
        feeds.send(2, "snapshot", [21], 32)
        assert f.unsynced() == 2  # nothing arrived yet: the index is stale for both
        f.sync(feeds.live)
        await settle()
        assert index.overlap([11, 12]) == {1: 2, 2: 0} and f.unsynced() == 0
        feeds.send(2, "stored", [11])
        feeds.send(1, "removed", [12])
        feeds.send(1, "load", running=3, waiting=2, kv_usage=0.25)
        await settle()
        assert index.overlap([11, 12]) == {1: 1, 2: 1}
        assert f.loads == {1: 5, 2: 0}  # running + waiting (a snapshot has them too)
        assert f.kv_usage == {1: 0.25, 2: 0.0}

        feeds.queues[1].put_nowait(None)  # instance 1's stream ends (it fell behind)
        await settle()
        assert 1 not in index.instances() and 1 not in f.loads and f.unsynced() == 1
        feeds.send(1, "snapshot", [11, 12, 13], 32)
        f.sync(feeds.live)  # still in discovery: followed again, from a fresh snapshot
        await settle()
        assert index.overlap([11, 12, 13]) == {1: 3, 2: 1} and f.snapshots == 3

        feeds.live = {1}  # instance 2 left discovery
        f.sync(feeds.live)
        await settle()
        assert index.instances() == {1}

        feeds.live = {1, 3}
        feeds.send(3, "snapshot", [11], 64)  # hashes another block size: never indexed
        f.sync(feeds.live)
        await settle()
        f.sync(feeds.live)
        await settle()
        assert index.instances() == {1} and feeds.calls.count(3) == 1
        f.sync(set())
        await settle()

    asyncio.run(scenario())


def test_the_routers_metrics_read_both_tiers(hasher):
    """/metrics reads the router's state (router.metrics): every family renders, with the
    decode and prefill tiers' index sizes."""
    from mmhandoff.router.metrics import _Collector

    r = _router(hasher)
    r.decode.index.stored(10, [1, 2, 3])
    r.prefill.index.stored(20, [7])
    values = {m.name: m.samples[0].value for m in _Collector(r, {}).collect() if m.samples}
    assert values["mmhandoff_router_index_blocks"] == 3
    assert values["mmhandoff_router_index_instances"] == 1
    assert values["mmhandoff_router_prefill_index_blocks"] == 1


class _Decode(_Instances):
    """Decode's generate endpoint: records what each call was given, answers one chunk."""

    def __init__(self, ids):
        super().__init__(ids)
        self.got: list = []

    async def direct(self, request, instance_id, context=None):
        self.got.append((instance_id, request))

        async def stream():
            yield _Annotated({"token_ids": [1]})

        return stream()


def test_the_router_sends_on_the_bytes_it_got_and_reads_an_older_frontends_form(hasher):
    """The handoff crosses the router as prefill's bytes: decode gets the message unchanged. An
    older frontend's message (the Handoff's own fields) is routed the same."""
    h = sign(_typed(_handoff(list(range(100, 121)))), b"k" * 32, ttl_s=30)
    current, older = _message(h), msgspec.to_builtins(h)
    decode = _Decode((10, 20, 30))
    r = Router(decode, hasher=hasher)
    r.decode.index.stored(20, _blocks(r, current))
    assert r.pick(older) == (20, "overlap")

    async def through() -> list:
        return [chunk async for chunk in r.handle(current)]

    assert asyncio.run(through()) == [{"token_ids": [1]}]
    assert decode.got == [(20, current)]
    assert handoff_bytes(decode.got[0][1]) == encode_handoff(h)  # the bytes prefill signed
