"""Fail closed: when KV does not cover the image spans the request ends with KVCoverageError in
bounded time, the engine core survives, and the next request is answered correctly."""

from __future__ import annotations

import asyncio
import time

import msgspec
import pytest

from mmhandoff.decode.worker import DecodeWorker, KVCoverageError, collect
from mmhandoff.prefill.worker import PrefillWorker
from mmhandoff.wire.messages import PrefillRequest
from tests.conftest import chat, data_uri, encode, free_port, make_image, start
from tests.flows import agg_run, greedy

pytestmark = pytest.mark.engine


@pytest.fixture(scope="module")
def fault_engine(loop, tiny_model):
    """A decode engine with a tiny KV cache (11 usable blocks of 32 tokens) and the test
    connector that can fail loads on request."""
    from mmhandoff.vllm_adapter import EngineSpec

    engine = start(loop, EngineSpec(
        model=tiny_model, role="decode", dtype="float32", cpu_cores="1", nixl_port=free_port(),
        num_gpu_blocks_override=12, max_model_len=352, max_num_seqs=4,
        connector_module="tests.fault_connector.FaultInjectingNixlConnector"))
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def prefill(engines):
    return PrefillWorker(engines.prefill)


def _messages(seed: int, text: str = "What is this?"):
    return chat(text, data_uri(encode(make_image(200, 150, seed))))


async def _handoff(prefill, request_id, seed, sampling):
    h, _ = await prefill.handoff(PrefillRequest(request_id=request_id, messages=_messages(seed),
                                                sampling=sampling))
    return h


def _healthy(loop, prefill, engines, decode_engine, tag):
    """The engine still answers a handoff, token for token as the aggregated reference."""
    decode = DecodeWorker(decode_engine, kv_deadline_s=30)
    s = greedy(8, ignore_eos=True)

    async def run():
        h = await _handoff(prefill, f"healthy-{tag}", 900, s)
        return [h.first_token, *(await collect(decode.generate(h)))[0]]

    assert loop.run(run()) == loop.run(agg_run(prefill, engines.full, f"healthy-{tag}",
                                               _messages(900), s))


def _expect_kv_error(loop, decode, handoff, within_s):
    t0 = time.monotonic()
    with pytest.raises(KVCoverageError) as err:
        loop.run(collect(decode.generate(handoff)), timeout=within_s + 30)
    assert time.monotonic() - t0 < within_s
    return err.value


def test_no_kv_at_all(loop, prefill, engines):
    """A handoff with no transfer parameters: nothing to pull, image spans uncovered."""
    h = loop.run(_handoff(prefill, "nokv", 1, greedy(8)))
    h = msgspec.structs.replace(h, kv_transfer_params={})
    decode = DecodeWorker(engines.decode)
    e = _expect_kv_error(loop, decode, h, within_s=10)
    assert e.cause.startswith("no KV")
    _healthy(loop, prefill, engines, engines.decode, "nokv")


def test_prefill_gone(loop, prefill, engines):
    """The transfer parameters name a prefill whose side channel no longer answers."""
    h = loop.run(_handoff(prefill, "gone", 2, greedy(8)))
    params = dict(h.kv_transfer_params, remote_port=free_port(),
                  remote_engine_id="engine-that-is-gone")
    h = msgspec.structs.replace(h, kv_transfer_params=params)
    e = _expect_kv_error(loop, DecodeWorker(engines.decode, kv_deadline_s=30), h, within_s=40)
    assert "kv_load_failed" in e.cause or "kv_deadline" in e.cause
    _healthy(loop, prefill, engines, engines.decode, "gone")


def test_blocks_that_are_not_there(loop, prefill, engines):
    h = loop.run(_handoff(prefill, "noblocks", 3, greedy(8)))
    n = len(h.kv_transfer_params["remote_block_ids"][0])
    params = dict(h.kv_transfer_params, remote_block_ids=[[10**7 + i for i in range(n)]])
    h = msgspec.structs.replace(h, kv_transfer_params=params)
    _expect_kv_error(loop, DecodeWorker(engines.decode, kv_deadline_s=30), h, within_s=40)
    _healthy(loop, prefill, engines, engines.decode, "noblocks")


def test_injected_kv_load_failure(loop, prefill, engines, fault_engine):
    h = loop.run(_handoff(prefill, "inject-load-failure-1", 4, greedy(8)))
    e = _expect_kv_error(loop, DecodeWorker(fault_engine, kv_deadline_s=30), h, within_s=40)
    assert "kv_load_failed" in e.cause
    _healthy(loop, prefill, engines, fault_engine, "inject")


def test_preemption_that_drops_image_kv(loop, prefill, engines, fault_engine):
    """Two long answers on an 11-block cache: one is preempted, and the other one's growth
    evicts its blocks; on resume the image KV is gone and the request must fail closed."""
    decode = DecodeWorker(fault_engine, kv_deadline_s=60)
    s = greedy(260, ignore_eos=True)

    async def both():
        hs = [await _handoff(prefill, f"preempt-{i}", 10 + i, s) for i in range(2)]
        return await asyncio.gather(*(collect(decode.generate(h)) for h in hs),
                                    return_exceptions=True)

    results = loop.run(both(), timeout=240)
    errors = [r for r in results if isinstance(r, BaseException)]
    done = [r for r in results if not isinstance(r, BaseException)]
    assert len(errors) == 1 and isinstance(errors[0], KVCoverageError), results
    assert errors[0].cause.startswith("preempted")
    assert len(done) == 1 and len(done[0][0]) == 259  # after prefill's first token
    _healthy(loop, prefill, engines, fault_engine, "preempt")


def test_a_retry_after_an_injected_kv_failure_continues_from_the_first_token(
        loop, prefill, engines, fault_engine):
    """Through the frontend: prefill's first token goes out, decode's KV load fails (injected,
    as NIXL reports it), the frontend sends prefill the prompt followed by that token, and the
    answer goes on: equal to agg's, no token twice, and prefill holds no blocks afterwards."""
    import json
    import urllib.request

    from mmhandoff.agg.worker import AggWorker
    from mmhandoff.decode.worker import ERRORS as DECODE_ERRORS
    from mmhandoff.frontend.app import Frontend
    from mmhandoff.prefill.worker import ERRORS as PREFILL_ERRORS
    from tests.conftest import serve_app
    from tests.flows import opened, prefill_kv_usage, sealed, wait_for_prefill_kv
    from tests.local_plane import LocalClient

    decode, handoffs = DecodeWorker(fault_engine, kv_deadline_s=30), []

    async def failing_once(handoff):  # the first handoff's pull is reported failed
        if not handoffs:  # (unsigned: prefill here has no key)
            handoff = sealed(msgspec.structs.replace(opened(handoff),
                                                     request_id="inject-load-failure-retry"))
        handoffs.append(handoff)
        async for item in decode.handle(handoff):
            yield item

    base = prefill_kv_usage(loop, engines.prefill, engines.prefill_load, "retry-base")
    runner = Frontend(LocalClient(prefill.handle, PREFILL_ERRORS),
                      LocalClient(failing_once, DECODE_ERRORS), "tiny-llava").runner()
    url = serve_app(loop, runner)
    uri = data_uri(encode(make_image(200, 150, 905)))
    body = {"model": "tiny-llava", "max_tokens": 12, "temperature": 0, "ignore_eos": True,
            "stream": True, "messages": [{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": uri}},
                {"type": "text", "text": "What is this?"}]}]}
    try:
        request = urllib.request.Request(url + "/v1/chat/completions",
                                         data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=120) as r:
            events = [json.loads(line[6:]) for line in r.read().decode().split("\n\n")
                      if line.startswith("data: {")]
    finally:
        loop.run(runner.cleanup())
    text = "".join(e["choices"][0]["delta"].get("content", "") for e in events)
    (stats,) = [e["mmhandoff"] for e in events if "mmhandoff" in e]

    async def agg_text():
        chunks = AggWorker(engines.full).generate(PrefillRequest(
            request_id="retry-agg", messages=chat("What is this?", uri),
            sampling=greedy(12, ignore_eos=True)))
        return "".join([c.text async for c in chunks])

    assert text == loop.run(agg_text())
    assert stats["retries"] == 1 and len(handoffs) == 2
    first, retried = (opened(h) for h in handoffs)
    assert retried.first_token is not None and first.first_token is not None
    assert len(retried.token_ids) == len(first.token_ids) + 1  # the first token
    assert wait_for_prefill_kv(loop, engines, lambda u: u <= base, timeout=1.0)
