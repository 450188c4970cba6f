"""The workers as Dynamo runtime endpoints (file discovery, TCP request plane, loopback only):
the handoff through the runtime gives the same tokens as in-process, and typed errors arrive
typed."""

from __future__ import annotations

import msgspec
import pytest

from mmhandoff.decode.worker import collect
from mmhandoff.plane.runtime import RemoteError, call
from mmhandoff.wire.handoff import EmptyHash
from mmhandoff.wire.messages import PrefillAnswer, PrefillRequest
from tests.conftest import chat, data_uri, encode, make_image
from tests.flows import greedy, opened, sealed

pytestmark = pytest.mark.engine


async def _all(stream):
    return [item async for item in stream]


def test_handoff_through_the_runtime_equals_in_process(loop, dynamo):
    prefill, decode, p, d = dynamo
    messages = chat("Over the wire?", data_uri(encode(make_image(256, 192, 77))))
    request = PrefillRequest(request_id="dyn-1", messages=messages, sampling=greedy(16, ignore_eos=True))
    (answer,) = loop.run(_all(call(p, msgspec.to_builtins(request))))
    chunks = loop.run(_all(call(d, {"handoff": answer["handoff"]})))
    remote_tokens = [t for c in chunks for t in c["token_ids"]]
    assert chunks[-1]["finish_reason"] == "length"
    assert chunks[-1]["stats"]["kv_tokens_pulled"] > 0

    async def direct():
        h, _ = await prefill.handoff(msgspec.structs.replace(request, request_id="dyn-2"))
        return (await collect(decode.generate(h)))[0]

    assert remote_tokens == loop.run(direct())


def test_typed_errors_cross_the_runtime(loop, dynamo):
    _, _, p, d = dynamo
    with pytest.raises(RemoteError) as err:
        loop.run(_all(call(p, {"request_id": "x", "messages": "not a list"})))
    assert err.value.code == "invalid_request"
    with pytest.raises(RemoteError) as err:
        loop.run(_all(call(p, msgspec.to_builtins(PrefillRequest(
            request_id="x", messages=chat("bad", "data:image/png;base64,AAAA"))))))
    assert err.value.code == "invalid_image"

    request = PrefillRequest(request_id="dyn-3", sampling=greedy(4),
                             messages=chat("Errors?", data_uri(encode(make_image(90, 90, 78)))))
    (answer,) = loop.run(_all(call(p, msgspec.to_builtins(request))))
    h = opened(answer["handoff"])
    bad = sealed(msgspec.structs.replace(h, features=msgspec.structs.replace(
        h.features, mm_hashes={"image": [""]})))
    with pytest.raises(RemoteError) as err:
        loop.run(_all(call(d, bad)))
    assert err.value.code == EmptyHash.code
    no_kv = sealed(msgspec.structs.replace(h, kv_transfer_params={}))
    with pytest.raises(RemoteError) as err:
        loop.run(_all(call(d, no_kv)))
    assert err.value.code == "kv_coverage" and err.value.cause.startswith("no KV")


def test_router_passes_handoffs_and_errors_through(loop, dynamo):
    """The disagg_router graph's router (pass-through until the KV router lands): the same
    tokens as decode directly, and decode's typed errors arrive unchanged."""
    import asyncio

    from mmhandoff.plane.runtime import client, runtime, serve
    from mmhandoff.router.router import Router

    _, _, p, d = dynamo

    async def up():
        rt = runtime(asyncio.get_running_loop(), discovery="file", request_plane="tcp")
        serve(rt, "mmhtest.router.generate", Router(d).handle, ())
        return rt, await client(rt, "mmhtest.router.generate")

    rt, r = loop.run(up())
    try:
        request = PrefillRequest(request_id="dyn-r", sampling=greedy(8, ignore_eos=True),
                                 messages=chat("Routed?", data_uri(encode(make_image(90, 70, 79)))))
        (first,) = loop.run(_all(call(p, msgspec.to_builtins(request))))
        (second,) = loop.run(_all(call(p, msgspec.to_builtins(request))))
        routed = [t for c in loop.run(_all(call(r, {"handoff": first["handoff"]})))
                  for t in c["token_ids"]]
        direct = [t for c in loop.run(_all(call(d, {"handoff": second["handoff"]})))
                  for t in c["token_ids"]]
        assert routed == direct and len(routed) == 7  # after prefill's first token
        with pytest.raises(RemoteError) as err:
            loop.run(_all(call(r, sealed(msgspec.structs.replace(opened(first["handoff"]),
                                                                 kv_transfer_params={})))))
        assert err.value.code == "kv_coverage" and err.value.message.startswith("request")
    finally:
        rt.shutdown()


def test_full_media_arm_endpoint_handlers(loop, dynamo, engines):
    """The benchmark arm's endpoint handlers, in their wire forms: prefill answers with prompt + image bytes, decode (with the
    vision tower) re-processes them; same tokens as the handoff, and decode got the media."""
    from mmhandoff.decode.full_media import FullMediaDecodeWorker
    from mmhandoff.prefill.full_media import FullMediaPrefillWorker

    prefill, _, p, d = dynamo
    png = encode(make_image(160, 120, 80))
    request = PrefillRequest(request_id="dyn-f", sampling=greedy(8, ignore_eos=True),
                             messages=chat("Full media?", data_uri(png)))
    (answer,) = loop.run(_all(FullMediaPrefillWorker(engines.prefill).handle(
        msgspec.to_builtins(request))))
    typed = msgspec.convert(answer, PrefillAnswer)
    assert typed.handoff is None and typed.full_media is not None  # the media, not a Handoff
    chunks = loop.run(_all(FullMediaDecodeWorker(engines.full).handle(typed.for_decode())))
    full = [t for c in chunks for t in c["token_ids"]]
    assert chunks[-1]["stats"]["request_bytes"] > len(png)  # the media went to decode

    (h,) = loop.run(_all(call(p, msgspec.to_builtins(msgspec.structs.replace(
        request, request_id="dyn-f2")))))
    handoff = [h["first"]["token_id"]] + [  # prefill's token, then decode's
        t for c in loop.run(_all(call(d, {"handoff": h["handoff"]}))) for t in c["token_ids"]]
    assert full == handoff and len(full) == 8


def test_call_one_answers_before_the_stream_ends(loop, dynamo_rt):
    """call_one returns a one-answer endpoint's item as soon as it arrives (the stream's end is
    drained in the background), and turns an error envelope or an empty answer into a typed
    RemoteError."""
    import asyncio

    from mmhandoff.plane.runtime import call_one, client, serve

    ended = asyncio.Event()

    async def slow_end(request):
        yield {"answer": request["n"] + 1}
        await asyncio.sleep(0.5)  # the stream's end comes late: the caller must not wait for it
        ended.set()

    async def failing(request):
        raise RemoteError("invalid_request", "no")
        yield  # pragma: no cover

    async def empty(request):
        return
        yield  # pragma: no cover

    async def scenario():
        serve(dynamo_rt, "mmhtest.slowend.generate", slow_end, ())
        serve(dynamo_rt, "mmhtest.failing.generate", failing, (RemoteError,))
        serve(dynamo_rt, "mmhtest.empty.generate", empty, ())
        slow, bad, none = [await client(dynamo_rt, f"mmhtest.{n}.generate")
                           for n in ("slowend", "failing", "empty")]
        assert await call_one(slow, {"n": 41}) == {"answer": 42}
        assert not ended.is_set()  # answered while the handler was still running
        await asyncio.wait_for(ended.wait(), 10)  # and the drained stream still ran to its end
        with pytest.raises(RemoteError) as err:
            await call_one(bad, {})
        assert err.value.code == "invalid_request"
        with pytest.raises(RemoteError) as err:
            await call_one(none, {})
        assert err.value.code == "internal"

    loop.run(scenario())


def test_request_plane_connections_have_nagle_off(loop, dynamo_rt):
    """Dynamo 1.6's request-plane server leaves Nagle on for the connections it accepts (with
    several requests in flight its acknowledgements then waited 40 ms: plane/nodelay.py). After
    served requests, the connections the request plane's listener accepted (its port as the
    endpoint advertises it in discovery) have TCP_NODELAY."""
    import asyncio
    import json
    import os
    import socket
    from pathlib import Path

    import psutil

    from mmhandoff.plane.runtime import call_one, client, serve

    async def echo(request):
        yield {"n": request["n"]}

    async def scenario():
        serve(dynamo_rt, "mmhtest.echo.generate", echo, ())
        c = await client(dynamo_rt, "mmhtest.echo.generate")
        answers = await asyncio.gather(*[call_one(c, {"n": i}) for i in range(8)])
        assert [a["n"] for a in answers] == list(range(8))

    loop.run(scenario())
    (record,) = [json.loads(f.read_text()) for f in Path(os.environ["DYN_FILE_KV"]).rglob("*")
                 if f.is_file() and "mmhtest%2Fecho%2Fgenerate" in f.name]
    port = int(record["transport"]["tcp"].split("/")[0].rsplit(":", 1)[1])
    tcp = psutil.Process().net_connections(kind="tcp")
    assert any(c.status == psutil.CONN_LISTEN and c.laddr.port == port for c in tcp)
    accepted = [c for c in tcp if c.status == psutil.CONN_ESTABLISHED and c.laddr.port == port]
    assert accepted  # the connection that carried the requests
    for c in accepted:
        with socket.socket(fileno=os.dup(c.fd)) as s:
            assert s.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY), c
