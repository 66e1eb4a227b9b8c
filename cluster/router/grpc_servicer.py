"""The servicer function for Serve's gRPC proxy (`grpc_options.grpc_servicer_functions`):
registers tandem.v1.Tandem with the proxy, and makes a client's cancel always reach the request.

Why: Serve's proxy (2.60) cancels the request behind a server-streaming call only when the
client's cancel lands while the proxy awaits the next message from the router. When it lands
while gRPC is writing a message to the client, the proxy's generator is closed at its `yield`,
swallows that (its proxy.py logs "async generator ignored GeneratorExit"), and the request runs
on to its last token, holding a decode slot and its KV blocks. Measured on 2 idle cores (the
tiny model, 60 calls each cancelled after 1-6 messages): 17 of the 60 cancels were lost.

The fix: the proxy's streaming handler runs in a task of its own that only ever waits on the
router, and our handler writes its messages (`context.write`), so gRPC's cancel always lands in
ours, wherever it comes. We cancel that task, which lands where the proxy does cancel the
request, and wait for it before the call ends: the proxy still touches the call's context as it
finishes (its access log asks for the peer), and doing that after gRPC has let go of the call
crashes the proxy (SIGSEGV, seen when this waited for nothing). The queue holds what Serve's
stream would otherwise have held, since Ray's streams have no backpressure either.

This module is imported by Serve's proxy process: keep it light (no torch, no router).
"""

from __future__ import annotations

import asyncio
import inspect
from typing import Any, AsyncIterator, Awaitable, Callable

from cluster.router.tandem_pb2_grpc import add_TandemServicer_to_server

_END = object()


def add_tandem_servicer(servicer: Any, server: Any) -> None:
    """What `grpc_servicer_functions` names (cluster.router.grpc_api.SERVICER). On any server
    but Serve's it registers the service as the generated function does."""
    factory = getattr(server, "service_handler_factory", None)  # Serve's gRPCGenericServer
    if not callable(factory):
        add_TandemServicer_to_server(servicer, server)
        return
    server.service_handler_factory = cancel_safe_factory(factory)  # for our service only
    try:
        add_TandemServicer_to_server(servicer, server)
    finally:
        server.service_handler_factory = factory


def cancel_safe_factory(factory: Callable[..., Any]) -> Callable[..., Any]:
    def make(service_method: str, streaming_type: Any) -> Any:
        handler = factory(service_method=service_method, streaming_type=streaming_type)
        if getattr(streaming_type, "name", "") == "UNARY_STREAM" and inspect.isasyncgenfunction(handler):
            return cancel_safe_stream(handler)
        return handler
    return make


def cancel_safe_stream(handler: Callable[[Any, Any], AsyncIterator[Any]]) -> Callable[[Any, Any], Awaitable[None]]:
    """`handler` as a coroutine handler (gRPC's `context.write` style): its messages are pulled by
    a task of their own, and a cancel that lands anywhere in the call cancels that task while it
    waits inside `handler`. The call returns only once that task has finished, so `handler`
    never touches `context` after gRPC has let go of the call."""

    async def unary_stream(request: Any, context: Any) -> None:
        queue: asyncio.Queue = asyncio.Queue()  # unbounded: the pump never waits outside `handler`

        async def pump() -> None:
            try:
                async for message in handler(request, context):
                    queue.put_nowait(message)
            finally:
                queue.put_nowait(_END)

        task = asyncio.ensure_future(pump())
        try:
            while (message := await queue.get()) is not _END:
                await context.write(message)
            await task  # done: raises the handler's own error, as gRPC would have seen it
        except BaseException:
            task.cancel()
            while not task.done():  # the proxy cancels the request and ends the call's books
                try:
                    await asyncio.wait([task])
                except asyncio.CancelledError:
                    continue
            if not task.cancelled():
                task.exception()  # retrieved: a cancelled call's last errors are nobody's to answer
            raise

    return unary_stream
