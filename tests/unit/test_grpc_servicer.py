"""A gRPC client's cancel reaches the request however it lands (cluster/router/grpc_servicer.py).

Serve's gRPC proxy cancels the request behind a streaming call only if the cancel lands while it
awaits the router; one that lands while gRPC writes a message to the client closes its generator
at a `yield`, which it swallows. `proxy_stream` below has that shape (and, like Serve's access
log, reads the call's peer as it finishes), and `grpc_call` drives a handler the way grpc.aio's
server does."""

from __future__ import annotations

import asyncio
import inspect
from unittest import mock

import grpc
import pytest

from cluster.router import grpc_servicer
from cluster.router.grpc_servicer import add_tandem_servicer, cancel_safe_stream


class Context:
    """A call's servicer context: writes take `write_s` (gRPC sending to the client), and every
    use after the call has ended is recorded (in grpc.aio that is a use-after-free)."""

    def __init__(self, write_s: float = 0.05) -> None:
        self.write_s, self.received, self.ended, self.used_after_end = write_s, [], False, []
        self.writing = asyncio.Event()
        self.code = None

    async def write(self, message) -> None:
        self.received.append(message)
        self.writing.set()
        await asyncio.sleep(self.write_s)
        self.writing.clear()

    def peer(self) -> str:
        if self.ended:
            self.used_after_end.append("peer")
        return "ipv4:127.0.0.1:5555"

    def set_code(self, code) -> None:
        if self.ended:
            self.used_after_end.append("set_code")
        self.code = code


def proxy_stream(state: dict, messages: int = 1000):
    async def handler(request, context):
        try:
            for i in range(messages):
                try:
                    await asyncio.sleep(0.002)  # awaiting the router's next message
                except asyncio.CancelledError:
                    state["request_cancelled"] = True  # what Serve's ProxyResponseGenerator does
                    raise
                yield f"m{i}"
        except BaseException:  # as Serve's send_request_to_replica: caught, status computed
            pass
        context.peer()  # Serve's access log, once the stream is over
        context.set_code(grpc.StatusCode.OK)
        yield "status"  # Serve yields a status after that; a closed generator cannot
    return handler


async def grpc_call(handler, context: Context) -> None:
    """What grpc.aio's server does with a server-streaming handler of either style."""
    try:
        if inspect.isasyncgenfunction(handler):
            async for message in handler(None, context):
                await context.write(message)
        else:
            await handler(None, context)
    finally:
        context.ended = True


async def cancel_while_writing(handler) -> Context:
    context = Context()
    call = asyncio.ensure_future(grpc_call(handler, context))
    while len(context.received) < 3:
        await context.writing.wait()
        await asyncio.sleep(0.01)
    assert context.writing.is_set()  # the call is inside a write, not inside the handler
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call
    for _ in range(50):  # let the closed generators' finalizers run
        await asyncio.sleep(0.002)
    return context


def test_a_cancel_during_a_write_cancels_the_request():
    state = {}
    context = asyncio.run(cancel_while_writing(cancel_safe_stream(proxy_stream(state))))
    assert context.received == ["m0", "m1", "m2"]
    assert state.get("request_cancelled")
    assert context.used_after_end == []  # the proxy finished its books while the call was open

    # the same call straight on the proxy's handler: the request is never cancelled (Serve 2.60)
    bare = {}
    asyncio.run(cancel_while_writing(proxy_stream(bare)))
    assert not bare.get("request_cancelled")


def test_a_cancel_while_waiting_on_the_router_cancels_the_request():
    async def run(state):
        context = Context(write_s=0)
        call = asyncio.ensure_future(grpc_call(cancel_safe_stream(proxy_stream(state)), context))
        while len(context.received) < 3:
            await asyncio.sleep(0.001)
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call
        return context

    state = {}
    context = asyncio.run(run(state))
    assert state.get("request_cancelled") and context.used_after_end == []


def test_a_whole_call_passes_through_unchanged():
    async def run(handler):
        context = Context(write_s=0)
        await grpc_call(cancel_safe_stream(handler), context)
        return context

    context = asyncio.run(run(proxy_stream({}, messages=4)))
    assert context.received == ["m0", "m1", "m2", "m3", "status"] and context.code == grpc.StatusCode.OK

    async def failing(request, context):
        yield "first"
        raise RuntimeError("the proxy failed")

    with pytest.raises(RuntimeError, match="the proxy failed"):
        asyncio.run(run(failing))


def test_serves_proxy_server_registers_the_wrapped_handler_for_tandem_only():
    from ray.serve._private.proxy_request_response import gRPCStreamingType
    from ray.serve._private.grpc_util import gRPCGenericServer

    made = []

    def factory(service_method, streaming_type):
        async def unary_stream(request, context):
            yield f"{service_method} via Serve"
        made.append((service_method, streaming_type))
        return unary_stream

    async def register():
        server = gRPCGenericServer(factory)
        add_tandem_servicer(mock.Mock(), server)
        assert server.service_handler_factory is factory  # restored for the services after ours
        (generic,) = server.generic_rpc_handlers[-1]
        handler = generic._method_handlers["/tandem.v1.Tandem/Generate"]
        context = Context(write_s=0)
        await grpc_call(handler.unary_stream, context)
        return handler, context.received

    handler, messages = asyncio.run(register())
    assert handler.unary_stream.__qualname__.startswith(cancel_safe_stream.__qualname__)
    assert messages == ["/tandem.v1.Tandem/Generate via Serve"]
    assert ("/tandem.v1.Tandem/Generate", gRPCStreamingType.UNARY_STREAM) in made


def test_grpc_options_name_it():
    from cluster.router import grpc_api

    module, _, name = grpc_api.SERVICER.rpartition(".")
    assert module == grpc_servicer.__name__ and getattr(grpc_servicer, name) is add_tandem_servicer
