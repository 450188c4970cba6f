"""BlockHasher (mmhandoff.vllm_adapter.block_hashes): the engine's prefix-cache block hashes,
computed outside it, bit for bit. Checked two ways: against an independent implementation of
vLLM's documented scheme (sha256 over the pickled (parent, block tokens, extra keys), NONE_HASH
from the seed) for block sizes 32, 64 and 128; and against the hashes a live prefill engine
and the decode engine that pulled them publish in their KV events for the same prompts (a
cache_salt included: prefill's engine ignored it until this test found that), and so do the
hashes a live prefill carries in its handoff for the router."""

from __future__ import annotations

import hashlib
import pickle
import random
import time

import msgspec
import pytest

from mmhandoff.frontend.placement import image_keys
from mmhandoff.router.index import KvIndex
from mmhandoff.vllm_adapter.block_hashes import BlockHasher
from mmhandoff.vllm_adapter.kv_events import feed
from mmhandoff.wire.handoff import BlockHashes
from mmhandoff.wire.messages import PrefillRequest
from tests.conftest import chat, data_uri, encode, make_image
from tests.flows import collect, greedy, published_chain

pytestmark = pytest.mark.engine  # vLLM's hasher: the engine tier's interpreter has vLLM loaded


def _reference(token_ids, images, block_size, cache_salt=None, seed="0") -> list[int]:
    """vLLM's scheme, written from its description: each full block's hash is sha256 of the
    pickled (parent hash, block tokens, extra keys); extra keys are ("mm", identity, offset of
    the image's first token relative to the block) for each image overlapping the block, and
    ("cache_salt", salt) on the first block; the first block's parent is sha256 of the pickled
    seed; KV events carry the low 64 bits, big-endian."""
    def sha(obj) -> bytes:
        return hashlib.sha256(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)).digest()

    parent, out = sha(seed), []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        end = start + block_size
        extra = [("mm", identity, offset - start) for identity, offset, length in images
                 if offset < end and offset + length > start]
        if start == 0 and cache_salt:
            extra.append(("cache_salt", cache_salt))
        parent = sha((parent, tuple(token_ids[start:end]), tuple(extra) or None))
        out.append(int.from_bytes(parent, "big") & (2**64 - 1))
    return out


PROMPTS = {  # (tokens, images as (identity, offset, length), cache_salt)
    "text only": (list(range(1, 300)), [], None),
    "one image": (list(range(1, 700)), [("a" * 64, 5, 576)], None),
    "image spanning blocks, then another": (
        list(range(1, 1400)), [("a" * 64, 40, 576), ("b" * 64, 700, 576)], None),
    "cache_salt": (list(range(1, 700)), [("a" * 64, 5, 576)], "tenant-7"),
}


@pytest.mark.parametrize("block_size", [32, 64, 128])
@pytest.mark.parametrize("case", list(PROMPTS))
def test_hashes_follow_vllms_scheme(case, block_size):
    tokens, images, salt = PROMPTS[case]
    got = BlockHasher(block_size).hashes(tokens, images, cache_salt=salt)
    assert len(got) == len(tokens) // block_size
    assert got == _reference(tokens, images, block_size, salt)


def test_an_images_identity_changes_its_blocks_and_those_after_only():
    tokens, images, _ = PROMPTS["image spanning blocks, then another"]
    hasher = BlockHasher(32)
    base = hasher.hashes(tokens, images)
    other = hasher.hashes(tokens, [images[0], ("c" * 64, 700, 576)])
    first_changed = 700 // 32
    assert other[:first_changed] == base[:first_changed]
    assert all(a != b for a, b in zip(other[first_changed:], base[first_changed:]))
    assert hasher.hashes(tokens[:320], images[:1]) == base[:10]  # a prefix's hashes: a prefix


def test_one_process_hashes_with_one_seed():
    BlockHasher(32)
    with pytest.raises(ValueError, match="seed"):
        BlockHasher(32, seed=1)


@pytest.fixture(scope="module")
def prefill(engines):
    from mmhandoff.decode.worker import DecodeWorker
    from mmhandoff.prefill.worker import PrefillWorker

    return PrefillWorker(engines.prefill), DecodeWorker(engines.decode, kv_deadline_s=30)


LIVE = {
    "text only": ([], None),
    "one image": ([(640, 480, 21)], None),
    "two images": ([(320, 240, 22), (96, 128, 23)], None),
    "cache_salt": ([(640, 480, 21)], "tenant-7"),
}


@pytest.mark.parametrize("case", list(LIVE))
def test_hashes_equal_the_engines_kv_events(loop, engines, prefill, case):
    prefill_worker, decode_worker = prefill
    images, salt = LIVE[case]
    uris = [data_uri(encode(make_image(w, h, seed))) for w, h, seed in images]
    words = " ".join(random.Random(len(case)).choice(["red", "blue", "cat", "sky"])
                     for _ in range(80))  # text of its own: blocks the engine has not seen
    request = PrefillRequest(request_id=f"bh-{case}", messages=chat(f"{case}: {words}", *uris),
                             sampling=greedy(2), cache_salt=salt)
    request = msgspec.structs.replace(request, image_keys=image_keys(request))
    prefixes: dict[str, list] = {}  # what prefill publishes for the router's placement

    async def run():
        prefill_worker.publish_prefixes = prefixes.update
        try:
            handoff, _ = await prefill_worker.handoff(request)
        finally:
            prefill_worker.publish_prefixes = None
        await collect(decode_worker.generate(handoff))  # pulls, and so frees prefill's blocks
        return handoff

    h = loop.run(run())
    assert len(h.token_ids) >= 64
    deadline = time.monotonic() + 10
    while None in (published_chain(engines.prefill_events, h.token_ids),
                   published_chain(engines.decode_events, h.token_ids)):
        assert time.monotonic() < deadline, "an engine published no KV events for the prompt"
        time.sleep(0.05)
    published = published_chain(engines.prefill_events, h.token_ids)
    assert BlockHasher(32).of_handoff(h) == published
    assert published_chain(engines.decode_events, h.token_ids) == published  # decode: the same
    # the hashes the handoff carries for routers (prefill's engine adapter): the same
    assert h.block_hashes == BlockHashes(block_size=32, hashes=published)
    # the router's index, fed the engines' own events, finds the whole prompt on both
    index = KvIndex()
    feed(index, 1, engines.prefill_events.events())
    feed(index, 2, engines.decode_events.events())
    assert index.overlap(BlockHasher(32).of_handoff(h)) == {1: len(published),
                                                          2: len(published)}
    # prefill's published image prefixes (the engine adapter's block_hashes): the same hashes,
    # the full blocks through each image
    ends = sorted(s.offset + s.length for _, _, s in h.items())
    assert len(prefixes) == len(images) == len(ends)
    for key, end in zip(request.image_keys, ends):
        assert prefixes[key] == published[:end // 32]
    if salt:  # the salt is in the hashes: the unsalted prompt's would differ
        assert BlockHasher(32).hashes(h.token_ids, [(d, s.offset, s.length)
                                                   for _, d, s in h.items()]) != published
