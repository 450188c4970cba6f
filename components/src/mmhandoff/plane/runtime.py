"""The Dynamo runtime side of a component: connect, serve one endpoint, carry typed errors.

Dynamo endpoints carry JSON-like values. Our wire structs travel as their builtin form
(`msgspec.to_builtins`) and are decoded strictly on arrival. An exception raised in a handler
reaches the caller as a plain ValueError with the type name folded into the text, so handlers
yield an error envelope instead (`{"error": {"code", "message", "cause"}}`) and `raise_for_error`
turns it back into a typed exception on the client side.

Defaults are for one host: file discovery in $DYN_FILE_KV, TCP request plane, every advertised
address on loopback unless $POD_IP names this host's (mmhandoff.plane.addresses).
"""

from __future__ import annotations

import asyncio
import logging
import os
from typing import Any, AsyncIterator, Callable, Coroutine

import msgspec

from mmhandoff.plane.nodelay import servers_without_delay
from mmhandoff.wire.messages import ErrorEnvelope, RemoteFault

log = logging.getLogger(__name__)


class RemoteError(RuntimeError):
    """A typed error from another component; `code` says which rule or failure, `fault` whose
    it is ("client": the request as the client sent it; "server": ours)."""

    def __init__(self, code: str, message: str, cause: str | None = None,
                 fault: str = "server") -> None:
        super().__init__(f"[{code}] {message}")
        self.code, self.message, self.cause, self.fault = code, message, cause, fault


def error_envelope(exc: BaseException) -> dict[str, Any]:
    """An exception as an ErrorEnvelope in builtin form. Its class says whose fault it is
    (`fault = "client"`); anything that does not say is ours."""
    fault = getattr(exc, "fault", "server")
    return msgspec.to_builtins(ErrorEnvelope(error=RemoteFault(
        code=str(getattr(exc, "code", "internal")),
        message=str(getattr(exc, "message", str(exc))), cause=getattr(exc, "cause", None),
        fault=fault if fault in ("client", "server") else "server")))


def raise_for_error(item: Any) -> Any:
    if isinstance(item, dict) and "error" in item:
        try:
            e = msgspec.convert(item, ErrorEnvelope).error
        except msgspec.ValidationError as bad:
            raise RemoteError("internal", f"malformed error envelope: {bad}") from None
        raise RemoteError(e.code, e.message, e.cause, e.fault)
    return item


def run(main: Coroutine[Any, Any, int]) -> int:
    """Run a component's main coroutine on uvloop: each Dynamo hop, HTTP request and engine output
    wakes the loop, and uvloop's wake-ups and socket I/O cost a fraction of asyncio's."""
    import uvloop

    return uvloop.run(main)


def runtime(loop: asyncio.AbstractEventLoop, *, discovery: str | None = None,
            request_plane: str | None = None, nixl_host: str | None = None):
    """The component's Dynamo runtime. `nixl_host`: its engine's side-channel address, checked
    with the others (a loopback address in a multi-host graph is reported on stderr)."""
    from dynamo.runtime import DistributedRuntime

    from mmhandoff.plane.addresses import loopback_warning, set_advertised_defaults

    set_advertised_defaults()
    if warning := loopback_warning(os.environ, nixl_host):
        log.warning(f"[mmhandoff] WARNING: {warning}")
    return DistributedRuntime(
        loop, discovery or os.environ.get("MMHANDOFF_DISCOVERY", "file"),
        request_plane or os.environ.get("MMHANDOFF_REQUEST_PLANE", "tcp"))


def endpoint_handler(handler: Callable[[Any], AsyncIterator[Any]],
                     errors: tuple[type[BaseException], ...], *, served: bool = False) -> Callable:
    """`handler` as a Dynamo endpoint: exceptions of the `errors` types become error envelopes;
    anything else fails the stream. When the caller stops the stream (client gone), the handler
    is closed at its next item, which is where workers abort their engine request and free its
    KV. `served`: Dynamo's request plane calls it (`serve`): at its first request, Nagle off on
    the process's servers (`_nagle_off`); in-process callers (tests' planes) leave that alone."""
    first = served

    async def endpoint(request, context=None):
        nonlocal first
        if first:
            first = False
            _nagle_off()
        items = handler(request)
        try:
            async for item in items:
                if context is not None and context.is_stopped():
                    return
                yield item
        except errors as exc:
            yield error_envelope(exc)
        finally:
            await items.aclose()

    return endpoint


def _nagle_off() -> None:
    """At an endpoint's first request through Dynamo, the request plane's listener and the
    connection that carried it exist: Nagle off on both (plane/nodelay.py: 40 ms per request
    otherwise, with several in flight). Once per endpoint, so that a listener a later runtime
    of the process opens is not missed; the scan takes a few ms (~4 for 300 descriptors on the
    2-core host), once."""
    try:
        changed = servers_without_delay()
    except Exception as e:  # a latency fix: never the request's failure
        log.warning(f"[mmhandoff] could not set TCP_NODELAY on this process's servers: {e!r}")
        return
    if changed:
        log.info(f"[mmhandoff] TCP_NODELAY set on {changed} server socket(s) of this process")


def serve(rt, path: str, handler: Callable[[Any], AsyncIterator[Any]],
          errors: tuple[type[BaseException], ...], *, endpoint=None) -> asyncio.Future:
    """Serve `handler` at `path` ("namespace.component.endpoint"); see endpoint_handler.
    `endpoint`: the runtime's Endpoint for `path`, when the caller took it already (take each
    one before serving anything: plane/registration.py says why)."""
    target = endpoint if endpoint is not None else rt.endpoint(path)
    return asyncio.ensure_future(target.serve_endpoint(endpoint_handler(handler, errors,
                                                                        served=True)))


async def client(rt, path: str, timeout_s: float = 30.0):
    c = await rt.endpoint(path).client()
    await asyncio.wait_for(c.wait_for_instances(), timeout_s)
    return c


async def call(c, request: Any, instance_id: int | None = None, *, lost: str = "internal",
               stall_s: float | None = None) -> AsyncIterator[Any]:
    """Stream the data items of one request, raising `RemoteError` on an error envelope. If the
    caller stops early (an error, a cancelled task, a closed generator), the remote handler is
    told to stop generating.

    Whatever else goes wrong on the way (no live instance, the instance died mid-stream, its
    handler failed outside its typed errors: Dynamo raises a plain exception for each) is the
    callee's failure: `RemoteError(lost)`, ours. `stall_s` bounds the wait for each item: a callee
    that stays silent longer is treated as lost too (a process stopped, a network partition)."""
    from dynamo.runtime import Context

    context = Context()
    done = False
    try:
        async with asyncio.timeout(stall_s):
            if instance_id is None:
                stream = await c.round_robin(request, context=context)
            else:
                stream = await c.direct(request, instance_id, context=context)
        while True:
            try:
                async with asyncio.timeout(stall_s):
                    annotated = await anext(stream)
            except StopAsyncIteration:
                break
            yield raise_for_error(annotated.data())
        done = True
    except TimeoutError:
        raise RemoteError(lost, f"no answer for {stall_s:g} s") from None
    except RemoteError:  # a typed error of the callee's: as it came
        raise
    except Exception as e:  # Dynamo's: routing failed, stream broken, handler failed untyped
        if TOO_LARGE in str(e):  # refused before sending: over the plane's message limit
            raise RemoteError(
                "request_too_large", "the request is larger than the request plane carries "
                "(NATS: the server's max_payload); send smaller or fewer images",
                fault="client") from None
        raise RemoteError(lost, f"{type(e).__name__}: {e}") from None
    finally:
        if not done:
            context.stop_generating()


# Dynamo's words for a request over the request plane's limit (NATS max_payload, 1 MiB unless
# the server raises it; an image is carried to prefill in the request).
TOO_LARGE = "payload is too large"

_background: set[asyncio.Task] = set()


def background(coro: Coroutine[Any, Any, Any]) -> asyncio.Task:
    """Run `coro` on its own, off any request's path, and keep it alive until done."""
    task = asyncio.ensure_future(coro)
    _background.add(task)  # the loop keeps only weak references to tasks
    task.add_done_callback(_background.discard)
    return task


async def call_one(c, request: Any, instance_id: int | None = None, *, lost: str = "internal",
                   stall_s: float | None = None) -> Any:
    """The answer of an endpoint that yields exactly one item, as soon as it arrives. The end of
    its stream comes ~0.5-1 ms later (measured on the 2-core machine); it is awaited in the
    background instead of on the request's path."""
    items = call(c, request, instance_id, lost=lost, stall_s=stall_s)
    try:
        item = await anext(items)
    except StopAsyncIteration:
        raise RemoteError(lost, "the endpoint ended its answer without an item") from None
    background(_drain(items))
    return item


async def _drain(items: AsyncIterator[Any]) -> None:
    async for _ in items:  # a second item is not part of the contract: dropped
        pass
